"""`paths train`: fine-tune one claimed path (lm or sft) with exact resume and lease fencing.

The loop, top to bottom: materialize the path; build model, AdamW, warmup + cosine schedule and
the path's data; resume from the newest intact committed checkpoint; then per optimizer step pull
`grad_accum` micro-batches, normalise the loss by the step's target count (so 4x1 equals 1x4),
clip, step. A heartbeat thread renews the lease; a refused renewal stops the loop before anything
more is written (fencing). SIGTERM / SIGINT checkpoint, hand the path back (state `open`) and exit.
Only rank 0 touches the run; ranks agree on stopping through an all-reduce each step.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from paths import checkpoint
from paths.claims import Lease
from paths.errors import ConfigurationError, LeaseLost, NotFound, PathsError
from paths.families import PARTS
from paths.train_config import TrainConfig
from storage.layout import Run
from storage.manifest import ArtifactWriter, sha256_hex

Mode = Literal["lm", "sft", "grpo"]


class Interrupted(PathsError):
    """Stopped by a signal after committing a checkpoint and handing the path back."""

    exit_code = 143


@dataclass(slots=True)
class Stop:
    """Why the loop must stop, set from the heartbeat thread or a signal handler."""

    lost: LeaseLost | None = None
    signal: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class Heartbeat(threading.Thread):
    """Renews the lease every `interval` seconds with the latest progress; marks a loss."""

    def __init__(self, lease: Lease, stop: Stop, interval: float):
        super().__init__(daemon=True, name="paths-heartbeat")
        self.lease, self.stop, self.interval = lease, stop, interval
        self.progress: dict[str, Any] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            try:
                self.renew()
            except LeaseLost:
                return  # recorded in stop.lost: the training loop stops at its next step

    def renew(self) -> None:
        """Renew now (also the fencing check before a commit); raises LeaseLost."""
        with self.stop.lock:
            try:
                self.lease.renew(**self.progress)
            except LeaseLost as exc:
                self.stop.lost = exc
                raise
            except PathsError:
                pass  # a transient storage error: the next beat retries well before expiry


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to 1, then cosine down to min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms and biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernel (CPU and CUDA) does the whole update in one pass per tensor.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)


def freeze_shared(model: torch.nn.Module, family, num_layers: int) -> int:
    """FlexOlmo's anchoring: only the path's experts (the dense MLP of each layer) keep gradients;
    attention, embeddings, norms and head are frozen, so they stay bitwise the base's. Returns
    the number of trainable parameters."""
    own = {family.dense_mlp(layer, part) for layer in range(num_layers) for part in PARTS}
    named = dict(model.named_parameters())
    missing = own - named.keys()
    if missing:
        raise ConfigurationError(f"--freeze shared: the path has no parameter {sorted(missing)[0]}: its checkpoint does not match the {family.name} family")
    for name, p in named.items():
        p.requires_grad_(name in own)
    return sum(p.numel() for name, p in named.items() if name in own)


def micro_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], total_targets: int) -> tuple[torch.Tensor, int]:
    """Summed next-token loss over the batch's real targets, divided by the step's target count."""
    tokens = batch["tokens"]  # (B, L+1)
    x, y = tokens[:, :-1], tokens[:, 1:].clone()  # (B, L)
    keep = target_mask(batch)
    y[~keep] = -100
    logits = model(input_ids=x.to(_device(model))).logits  # (B, L, V)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1).to(logits.device), ignore_index=-100, reduction="sum")
    return loss / max(1, total_targets), int(keep.sum())


def lm_step(cfg: TrainConfig):
    """The lm / sft step: grad_accum micro-batches, loss normalised by the step's targets."""

    def step(model, acc, it) -> dict[str, float]:
        batches = [next(it) for _ in range(cfg.grad_accum)]
        total = sum(targets_of(b) for b in batches)
        loss_sum = 0.0
        for b in batches:
            loss, _ = micro_loss(model, b, total)
            acc.backward(loss)
            loss_sum += float(loss.detach())
        return {"loss": loss_sum, "tokens": total}

    return step


class Counting:
    """A batch iterator that counts the samples it handed out (the data position to save)."""

    def __init__(self, it, start: int):
        self.it, self.consumed = it, start

    def __next__(self):
        batch = next(self.it)
        self.consumed += len(batch["index"])
        return batch


def target_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, L) the targets that count: real tokens, and for sft only completion tokens."""
    pos = torch.arange(batch["tokens"].shape[1] - 1).unsqueeze(0)  # (1, L)
    keep = pos < (batch["valid"].unsqueeze(1) - 1)
    if "loss_from" in batch:
        keep &= pos >= (batch["loss_from"].unsqueeze(1) - 1)
    return keep


def targets_of(batch: dict[str, torch.Tensor]) -> int:
    """Targets of a batch that count in the loss."""
    return int(target_mask(batch).sum())


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _rng_state() -> dict[str, str]:
    state = {"torch": torch.get_rng_state().numpy().tobytes().hex()}
    if torch.cuda.is_available():
        state["cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(bytes.fromhex(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(bytes.fromhex(s)), dtype=torch.uint8) for s in state["cuda"]])


def train(
    run: Run,
    path_id: str,
    mode: Mode,
    dataset: str,
    cfg: TrainConfig,
    lease: Lease | None,
    *,
    show_progress: bool = True,
    rewards: list[str] | None = None,
    init: Literal["base", "final"] = "base",
) -> dict[str, Any]:
    """Train a path to cfg.steps, resuming from its newest checkpoint of this job (mode and
    dataset); returns the summary. `rewards` (grpo): `NAME[=WEIGHT]` or `module:function[=WEIGHT]`.
    `init`: start from the path cut from base/, or from its `final/` (a stage after another)."""
    with torch.enable_grad():  # whatever the caller's global grad mode
        return _train(run, path_id, mode, dataset, cfg, lease, show_progress, list(rewards or ["math_answer"]), init)


def _train(run: Run, path_id: str, mode: Mode, dataset: str, cfg: TrainConfig, lease: Lease | None, show_progress: bool, rewards: list[str], init: str) -> dict[str, Any]:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from paths.decompose import materialize
    from experts.domain import data_id, is_expert, materialize_expert
    from sharding.dataset import PathDataset, dataset_manifest, path_entry

    if mode not in ("lm", "sft", "grpo"):
        raise ConfigurationError(f"--mode {mode!r} is not a training mode: use lm, sft or grpo")
    from paths.rewards import load_reward

    reward_fns = [load_reward(r) for r in rewards] if mode == "grpo" else []
    hf_logging.disable_progress_bar()
    cuda = torch.cuda.is_available()
    precision = {"auto": "bf16" if cuda else "no", "bf16": "bf16", "fp32": "no"}[cfg.precision]
    acc = Accelerator(mixed_precision=precision, cpu=not cuda)
    main = acc.is_main_process
    if not main:
        run.store.read_only = True  # only rank 0 writes to the run
    shard_id = data_id(run, path_id, dataset_manifest(run, dataset))  # a domain expert may read its domain's shard
    manifest, entry = path_entry(run, dataset, shard_id)
    if mode == "lm" and entry["train_tokens"] < 2:
        raise ConfigurationError(f"dataset {dataset!r} has no training tokens for path {path_id}: route data to it or pick another path")
    if mode in ("sft", "grpo") and manifest.get("data_kind") != "prompts":
        raise ConfigurationError(f"--mode {mode} needs a prompt dataset: shard {dataset!r} with --kind prompts --answer-field ANSWER")

    local = tempfile.mkdtemp(prefix=f"paths-train-{path_id}-")
    stop = Stop()
    beat: Heartbeat | None = None
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} if threading.current_thread() is threading.main_thread() else {}
    try:
        if init == "final":
            previous_stage = fetch_final(run, path_id, os.path.join(local, "init"))
        elif init == "base":
            if is_expert(run, path_id):
                materialize_expert(run, path_id, os.path.join(local, "init"))
            else:
                materialize(run, path_id, os.path.join(local, "init"))
            previous_stage = None
        else:
            raise ConfigurationError(f"--init must be base or final, got {init!r}")
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(os.path.join(local, "init"), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(local, "init"))
        if cfg.freeze == "shared":
            from paths.base import require_base
            from paths.families import get_family

            freeze_shared(model, get_family(require_base(run)["base"]["family"]), model.config.num_hidden_layers)
        optimizer = make_optimizer(model, cfg)
        common = dict(seed=cfg.seed, batch_size=cfg.batch_size, rank=acc.process_index, world_size=acc.num_processes)
        if mode == "lm":
            data = PathDataset(run, dataset, shard_id, cfg.seq_len, **common)
            step_fn = lm_step(cfg)
        elif mode == "sft":
            from paths.sft_data import SFTDataset

            data = SFTDataset(run, dataset, shard_id, cfg.seq_len, tokenizer, **common)
            step_fn = lm_step(cfg)
        else:
            from paths.grpo import GRPOStep, check_prompts
            from paths.sft_data import PromptDataset

            data = PromptDataset(run, dataset, shard_id, cfg.seq_len, **common)
            check_prompts(data.records, reward_fns, dataset)
            ref = AutoModelForCausalLM.from_pretrained(os.path.join(local, "init"), dtype=torch.float32).eval() if cfg.beta > 0 else None
            step_fn = GRPOStep(cfg, data.records, reward_fns, tokenizer, ref)

        start, tokens_seen, last_loss, metrics = 0, 0, None, []
        resumed = checkpoint.load_latest(run, path_id, {"mode": mode, "dataset": dataset, "freeze": cfg.freeze})
        if resumed is not None:
            start, model_sd, opt_sd, state = resumed
            model.load_state_dict(model_sd)
            checkpoint.load_optimizer(optimizer, opt_sd, state["optimizer"])
            data.load_state_dict(state["data"][acc.process_index] if isinstance(state["data"], list) else state["data"])
            _set_rng_state(state["rng"])
            tokens_seen, last_loss = state["tokens"], state["loss"]
            metrics = [m for m in _read_metrics(run, path_id) if m["step"] <= start]
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg), last_epoch=start - 1) if start else torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
        model, optimizer = acc.prepare(model, optimizer)

        if main and lease is not None:
            beat = Heartbeat(lease, stop, interval=max(0.2, min(lease.ttl / 3, 30.0)))
            beat.renew()  # we hold it now, or stop before any work
            beat.start()
        if previous:
            for s in previous:
                signal.signal(s, lambda signum, frame: setattr(stop, "signal", signum))

        def fence() -> None:
            if beat is not None:
                beat.renew()

        def save_checkpoint(step: int) -> dict[str, Any] | None:
            state = {
                "step": step, "tokens": tokens_seen, "loss": last_loss, "config": cfg.to_json(), "mode": mode, "freeze": cfg.freeze,
                "dataset": dataset, "data": _gather_positions(acc, data, it.consumed),
                "rng": _rng_state(), "generation": lease.generation if lease else None,
            }
            acc.wait_for_everyone()
            if not main:
                return None
            out = checkpoint.save(run, path_id, step, acc.unwrap_model(model), optimizer, state, fence)
            _write_metrics(run, path_id, metrics)
            checkpoint.prune(run, path_id, cfg.keep_checkpoints)
            if beat is not None:
                beat.progress["committed_step"] = step
            return out

        bar = _progress(show_progress and main, start, cfg.steps, path_id)
        # The loader gets its own generator: creating its iterator must not draw from the global
        # RNG, which the sampler uses and checkpoints save (resume is exact only that way).
        loader = torch.utils.data.DataLoader(data, batch_size=cfg.batch_size, num_workers=cfg.num_workers, generator=torch.Generator().manual_seed(cfg.seed))
        it = Counting(iter(loader), data.position)
        last_ckpt_time, t0, tokens_at_t0 = time.time(), time.time(), tokens_seen
        model.train()
        step = start
        while step < cfg.steps:
            _check_stop(acc, stop)
            stats = step_fn(model, acc, it)  # gradients of one optimizer step
            if cfg.max_grad_norm > 0:
                acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += stats.pop("tokens") * acc.num_processes
            last_loss = stats["loss"]
            rate = (tokens_seen - tokens_at_t0) / max(1e-9, time.time() - t0)
            metrics.append({"step": step, **stats, "lr": scheduler.get_last_lr()[0], "tokens": tokens_seen, "tokens_per_s": rate, "time": time.time()})
            if beat is not None:
                beat.progress.update(step=step, tokens=tokens_seen, loss=last_loss)
            bar.update(1)
            bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{rate:,.0f}", lease=f"{lease.time_left():.0f}s" if lease else "-")
            due = (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or time.time() - last_ckpt_time > cfg.checkpoint_minutes * 60
            between = step % getattr(step_fn, "checkpoint_multiple", 1) == 0  # grpo: not inside a rollout's iterations
            if due and between and step < cfg.steps:
                save_checkpoint(step)
                last_ckpt_time = time.time()
            if stop.lost is not None or (stop.signal is not None and between):
                _check_stop(acc, stop, save_checkpoint, step, lease)
        bar.close()
        _check_stop(acc, stop)
        summary = {"path": path_id, "mode": mode, "freeze": cfg.freeze, "steps": step, "tokens": tokens_seen, "final_loss": last_loss, "resumed_from": start, "init": init}
        # anchored: every shared tensor is still the base's (this stage froze them, and so did the one before)
        summary["anchored"] = cfg.freeze == "shared" and (previous_stage is None or bool(previous_stage.get("anchored")))
        if previous_stage is not None:
            summary["previous_stage"] = previous_stage
        acc.wait_for_everyone()
        if main:
            summary["final"] = _write_final(run, path_id, acc.unwrap_model(model), tokenizer, local, cfg, mode, dataset, manifest, summary, fence)
            _write_metrics(run, path_id, metrics)
            if lease is not None:
                beat.done.set()
                with stop.lock:
                    lease.finish("done", step=step, tokens=tokens_seen, loss=last_loss)
        return summary
    finally:
        if beat is not None:
            beat.done.set()
        for s, h in previous.items():
            signal.signal(s, h)
        shutil.rmtree(local, ignore_errors=True)


def fetch_final(run: Run, path_id: str, out: str) -> dict[str, Any]:
    """Download work/<path>/final/ (checked against its manifest); its provenance."""
    from storage.manifest import read_manifest, read_verified

    try:
        files = read_manifest(run.store, run.final(path_id))["files"]
    except NotFound:
        raise NotFound(f"path {path_id} has no final/ to start from in {run.url}: train it first, or use --init base") from None
    os.makedirs(out, exist_ok=True)
    for name in files:
        with open(os.path.join(out, name), "wb") as f:
            f.write(read_verified(run.store, run.final(path_id), name))
    with open(os.path.join(out, "provenance.json")) as f:
        return json.load(f)


def _gather_positions(acc, data, consumed: int) -> list[dict[str, Any]] | dict[str, Any]:
    """Every rank's data position (each rank consumed the same number of windows)."""
    state = data.state_dict(position=consumed)
    if acc.num_processes == 1:
        return state
    return [{**state, "rank": r} for r in range(acc.num_processes)]


def _check_stop(acc, stop: Stop, save=None, step: int | None = None, lease: Lease | None = None) -> None:
    """All ranks stop together: on a lost lease without writing, on a signal after a checkpoint."""
    flags = torch.tensor([stop.lost is not None, stop.signal is not None], dtype=torch.int64)
    if acc.num_processes > 1:
        flags = acc.reduce(flags, reduction="sum")
    if flags[0]:
        raise stop.lost or LeaseLost("rank 0 lost the lease: stopping without writing")
    if flags[1] and save is not None:
        save(step)
        if acc.is_main_process and lease is not None:
            with stop.lock:
                lease.finish("open", step=step, committed_step=step, handed_off_by=signal.Signals(stop.signal or signal.SIGTERM).name)
        name = signal.Signals(stop.signal).name if stop.signal else "a signal"
        raise Interrupted(f"stopped by {name} at step {step}: checkpoint committed and the path handed back; resume with `paths claim && paths train`")


def _progress(enabled: bool, start: int, total: int, path_id: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc=f"train {path_id}", unit="step", disable=not enabled or None)


def _read_metrics(run: Run, path_id: str) -> list[dict[str, Any]]:
    key = f"{run.work(path_id)}/metrics.jsonl"
    if not run.store.exists(key):
        return []
    return [json.loads(line) for line in run.store.read(key).decode().splitlines() if line.strip()]


def _write_metrics(run: Run, path_id: str, metrics: list[dict[str, Any]]) -> None:
    run.store.write(f"{run.work(path_id)}/metrics.jsonl", "".join(json.dumps(m) + "\n" for m in metrics).encode())


def _write_final(run, path_id, model, tokenizer, local, cfg, mode, dataset, manifest, summary, fence) -> str:
    """work/<path>/final/: the trained dense path (HF format) and its provenance, manifest last."""
    out = os.path.join(local, "final")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for identity in ("path.json", "expert.json"):  # what the unit is: a path of the plan, or a domain expert
        if os.path.exists(os.path.join(local, "init", identity)):
            shutil.copy(os.path.join(local, "init", identity), os.path.join(out, identity))
    provenance = {
        **summary, "config": cfg.to_json(), "dataset": dataset,
        "data_manifest_sha256": sha256_hex(json.dumps(manifest["files"], sort_keys=True).encode()),
        "finished_at": time.time(),
    }
    with open(os.path.join(out, "provenance.json"), "w") as f:
        json.dump(provenance, f, indent=2, sort_keys=True)
    writer = ArtifactWriter(run.store, run.final(path_id))
    for name in sorted(os.listdir(out)):
        writer.upload(name, os.path.join(out, name))
    fence()
    writer.commit(kind="final", path=path_id, steps=summary["steps"], tokens=summary["tokens"], final_loss=summary["final_loss"])
    return run.store.url_of(run.final(path_id))
