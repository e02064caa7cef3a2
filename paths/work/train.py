"""`paths train`: fine-tune one claimed unit (a path or domain expert) by lm, sft or grpo.

Materialize the unit (cut from base/, or its `final/` for a stage after another); build the model,
its data and its step (lm / sft: `paths.steps.LMStep`; grpo: `GRPOStep`); then `Trainer.fit`
(paths/trainer.py) runs the loop, with two callbacks: `LeaseKeeper` renews the lease from a
heartbeat thread (`paths train` starts it the moment it has the lease, before importing torch or
materializing anything, so a lease is covered from the first second) and fences every commit (a
refused renewal stops the loop before anything more is written), and `Signals` turns SIGTERM /
SIGINT into a committed checkpoint, the unit handed back (state `open`) and exit 143. Only rank 0
touches the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch

from paths.adapters import LoraSpec, adapter_state, attach, load_nf4, merge, spec_of, target_modules
from paths.checkpoint import check_resumable, start_digest
from paths.errors import ConfigurationError, LeaseLost
from paths.models import fetch_final, materialize, materialize_expert
from paths.steps import LMStep, ShardBatches
from paths.train_config import TrainConfig
from paths.tracking import accelerator
from paths.trainer import Callback, Signals, Trainer
from paths.units import data_id, is_expert
from paths.work import diloco
from paths.work.claims import Heartbeat, Lease, keep_alive
from storage.layout import Run
from storage.manifest import ArtifactWriter, sha256_hex

if TYPE_CHECKING:
    from paths.families import Family

Mode = Literal["lm", "sft", "grpo"]
ADAPTER_FILE = "adapter.safetensors"  # final/ of a LoRA unit: its adapter, beside the merged weights


class LeaseKeeper(Callback):
    """The claimed unit's lease: renewed by a heartbeat (the one `paths train` started before its
    heavy work, or a new one), checked before every commit, handed back (`open`) on a signal and
    finished (`done`) once the final is committed."""

    def __init__(self, lease: Lease, beat: Heartbeat | None = None):
        self.lease, self.beat = lease, beat

    def started(self, trainer: Trainer) -> None:
        def lost(exc: LeaseLost) -> None:
            trainer.stop.lost = exc

        if self.beat is None:
            self.beat = keep_alive(self.lease)
        self.beat.on_lost = lost
        self.beat.renew()  # we hold it now, or stop before any work

    def fence(self, trainer: Trainer) -> None:
        if self.beat is not None:
            self.beat.renew()

    def stepped(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.beat is not None:
            self.beat.progress.update(step=record["step"], tokens=record["tokens"], loss=record["loss"])

    def committed(self, trainer: Trainer, step: int) -> None:
        if self.beat is not None:
            self.beat.progress["committed_step"] = step

    def interrupted(self, trainer: Trainer, step: int, signal_name: str) -> None:
        with self._lock():
            self.lease.finish("open", step=step, committed_step=step, handed_off_by=signal_name)

    def finished(self, trainer: Trainer) -> None:
        self.hand_back("done", step=trainer.step, tokens=trainer.tokens, loss=trainer.loss)

    def hand_back(self, state: str, **fields: Any) -> None:
        """End this tenure with `state` (done; a DiLoCo path `waiting` for its round's outer step)."""
        self.close()
        with self._lock():
            self.lease.finish(state, **fields)

    def _lock(self) -> Any:
        return self.beat.lock if self.beat is not None else contextlib.nullcontext()

    def close(self) -> None:
        if self.beat is not None:
            self.beat.stop()

    def state(self) -> dict[str, Any]:
        return {"generation": self.lease.generation}

    def postfix(self) -> dict[str, str]:
        return {"lease": f"{self.lease.time_left():.0f}s"}


def freeze_shared(model: torch.nn.Module, family: Family, layers: list[int]) -> int:
    """FlexOlmo's anchoring: only the path's experts (the dense MLP of each layer) keep gradients;
    attention, embeddings, norms and head are frozen, so they stay bitwise the base's. Returns
    the number of trainable parameters."""
    own = {name for layer in layers for name in family.path_expert_parameters(layer)}
    named = dict(model.named_parameters())
    missing = own - named.keys()
    if missing:
        raise ConfigurationError(f"--freeze shared: the path has no parameter {sorted(missing)[0]}: its checkpoint does not match the {family.name} family")
    for name, p in named.items():
        p.requires_grad_(name in own)
    return sum(p.numel() for name, p in named.items() if name in own)


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
    heartbeat: Heartbeat | None = None,
    outer_step: diloco.OuterStep | None = None,
) -> dict[str, Any]:
    """Train a unit to cfg.steps, resuming from its newest checkpoint of this job (mode, dataset,
    freeze); returns the summary. `rewards` (grpo): `NAME[=WEIGHT]` or `module:function[=WEIGHT]`.
    `init`: start from the unit cut from base/, or from its `final/` (a stage after another).
    `heartbeat`: the lease's, already renewing (`paths train` starts it before any heavy work and
    stops it however training ends); the trainer adopts it. `outer_step`: a DiLoCo run's
    (`compose.diloco.outer_step`; `compose.diloco.train` passes it), which its workers compute."""
    with torch.enable_grad():  # whatever the caller's global grad mode
        return _train(run, path_id, mode, dataset, cfg, lease, show_progress, list(rewards or []), init, heartbeat, outer_step)


def _train(run: Run, path_id: str, mode: Mode, dataset: str, cfg: TrainConfig, lease: Lease | None, show_progress: bool, rewards: list[str], init: str,
           heartbeat: Heartbeat | None, outer_step: diloco.OuterStep | None) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from paths.envs.spec import check_versions
    from paths.work.episodes import dataset_scoring
    from sharding.dataset import PathDataset, dataset_manifest, path_entry

    if mode not in ("lm", "sft", "grpo"):
        raise ConfigurationError(f"--mode {mode!r} is not a training mode: use lm, sft or grpo")
    if init not in ("base", "final"):
        raise ConfigurationError(f"--init must be base or final, got {init!r}")
    if cfg.fsdp and mode == "grpo":
        raise ConfigurationError("--fsdp trains --mode lm and sft: GRPO samples on every rank at its own pace, which sharded layers cannot follow; drop --fsdp")
    if mode == "grpo":  # the rewards, and a multi-turn environment's episodes (its package version checked)
        reward_fns, episodes = dataset_scoring(run, dataset, rewards)
    else:
        check_versions(dataset_manifest(run, dataset).get("environments") or [], f"dataset {dataset!r}")
        reward_fns, episodes = [], None
    if episodes is not None and cfg.rollouts == "store" and cfg.external:
        raise ConfigurationError(f"dataset {dataset!r} comes from the multi-turn environment {episodes.spec.text!r}: SAPO's shared experience (external) takes single-turn batches; set external=0")
    if cfg.rollouts == "store" and mode != "grpo":
        raise ConfigurationError(f"--rollouts store feeds --mode grpo from rollout workers; --mode {mode} trains on the dataset itself")
    rounds = diloco.settings(run)
    if rounds is not None:
        check_rounds(run, path_id, rounds, mode, init, cfg)
        if outer_step is None:
            raise ConfigurationError(f"{run.url} trains in DiLoCo rounds, whose workers compute the outer steps: train its paths with compose.diloco.train (what `paths train` runs)")
    hf_logging.disable_progress_bar()
    acc = accelerator(cfg.precision, cfg.report_to, cfg.logging_dir)
    if not acc.is_main_process:
        run.store.read_only = True  # only rank 0 writes to the run
    if rounds is not None and acc.num_processes > 1:
        raise ConfigurationError(f"{run.url} trains in DiLoCo rounds, one process per path: launch `paths train` without accelerate's multi-process")
    shard_id = data_id(run, path_id, dataset_manifest(run, dataset))  # a domain expert may read its domain's shard
    manifest, entry = path_entry(run, dataset, shard_id)
    if mode == "lm" and entry["train_tokens"] < 2:
        raise ConfigurationError(f"dataset {dataset!r} has no training tokens for path {path_id}: route data to it or pick another path")
    if mode in ("sft", "grpo") and manifest.get("data_kind") != "prompts":
        raise ConfigurationError(f"--mode {mode} needs a prompt dataset: shard {dataset!r} with --kind prompts --answer-field ANSWER")

    local = tempfile.mkdtemp(prefix=f"paths-train-{path_id}-")
    try:
        start_dir = os.path.join(local, "init")
        if init == "final":
            previous_stage = fetch_final(run, path_id, start_dir)
        else:
            (materialize_expert if is_expert(run, path_id) else materialize)(run, path_id, start_dir)
            previous_stage = None
        torch.manual_seed(cfg.seed)
        lora = spec_of(cfg)
        job = {"mode": mode, "dataset": dataset, "freeze": cfg.freeze, "lora": lora.to_json() if lora else None, "start": start_digest(start_dir) if lora else None}
        check_resumable(run, path_id, job)
        model = load_nf4(start_dir, acc.device) if lora and lora.base == "nf4" else AutoModelForCausalLM.from_pretrained(start_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(start_dir)
        if cfg.freeze == "shared" or lora:
            from paths.base import require_base
            from paths.families import get_family

            family = get_family(require_base(run)["base"]["family"])
            layers = family.sparse_layers(model.config)
            if lora:  # only the adapter trains; under --freeze shared it sits beside the experts alone
                own = [name for layer in layers for name in family.path_expert_parameters(layer)]
                model = attach(model, lora, target_modules(model, lora, own, cfg.freeze == "shared", f"path {path_id}"))
                summary_lora = {"trainable": sum(p.numel() for p in model.parameters() if p.requires_grad), "base": lora.base}
            else:
                freeze_shared(model, family, layers)
        extra: list[Callback] = []
        summary_extra: dict[str, Any] = {"lora": {**lora.to_json(), **summary_lora}} if lora else {}
        common = dict(seed=cfg.seed, batch_size=cfg.batch_size, rank=acc.process_index, world_size=acc.num_processes)
        batches: Any = None
        if mode == "lm":
            data = PathDataset(run, dataset, shard_id, cfg.seq_len, **common)
            step = LMStep(cfg)
        elif mode == "sft":
            from paths.work.sft_data import SFTDataset

            data = SFTDataset(run, dataset, shard_id, cfg.seq_len, tokenizer, **common)
            step = LMStep(cfg)
        else:
            from paths.work.grpo import GRPOStep, HeldoutReward
            from paths.work.sampling import check_prompts
            from paths.work.sft_data import PromptDataset
            from sharding.dataset import read_prompts

            data = PromptDataset(run, dataset, shard_id, cfg.seq_len, mixture=cfg.mixture, **common)
            check_prompts(data.records, reward_fns, dataset, model.config.max_position_embeddings, cfg.max_new_tokens)
            ref = AutoModelForCausalLM.from_pretrained(start_dir, dtype=torch.float32).eval().requires_grad_(False) if cfg.beta > 0 else None
            if cfg.rollouts == "store":  # asynchronous: verified batches of rollout workers, policy versions published for them
                from paths.work.rollouts import AsyncGRPOStep, PolicyPublisher, StoreRollouts

                if acc.num_processes > 1:
                    raise ConfigurationError("--rollouts store runs one trainer process per path (rollout workers scale out instead): launch it without accelerate's multi-process")
                source = StoreRollouts(run, path_id, dataset, cfg, data.records, reward_fns, tokenizer, lambda: AutoModelForCausalLM.from_pretrained(start_dir, dtype=torch.float32),
                                      device=acc.device, episodes=episodes)
                summary_extra["rollouts"] = source.describe()
                step, batches = AsyncGRPOStep(cfg, source, ref, dataset), source
                extra.append(PolicyPublisher(run, path_id, cfg.max_async, source, cfg.grad_accum, cfg.policy_snapshot_every, lora,
                                             lambda: AutoModelForCausalLM.from_pretrained(start_dir, dtype=torch.float32)))
            else:
                step = GRPOStep(cfg, data.records, reward_fns, tokenizer, ref, dataset, sampler=episodes)
            if cfg.eval_every:
                heldout = read_prompts(run, dataset, shard_id, "heldout")[: cfg.eval_prompts]
                check_prompts(heldout, reward_fns, dataset, model.config.max_position_embeddings, cfg.max_new_tokens)  # on every rank: all fail alike
                if not heldout:
                    warnings.warn(f"eval_every {cfg.eval_every}: dataset {dataset!r} holds no held-out prompts for {shard_id} (shard with --holdout > 0): no held-out reward", stacklevel=2)
                elif acc.is_main_process:
                    extra.append(HeldoutReward(heldout, reward_fns, tokenizer, cfg.eval_every, cfg.max_new_tokens, episodes))
        keeper = LeaseKeeper(lease, heartbeat) if lease is not None and acc.is_main_process else None
        callbacks: list[Callback] = [keeper] if keeper is not None else []
        round_sync = diloco.RoundSync(run, path_id, rounds, outer_step, keeper, cfg.round_wait) if rounds is not None else None
        if round_sync is not None:
            callbacks.append(round_sync)
        callbacks += extra
        trainer = Trainer(
            run, path_id, job, cfg, model, step,
            batches or ShardBatches(data, cfg.batch_size, cfg.seed, cfg.num_workers), acc,
            callbacks=[Signals(), *callbacks], show_progress=show_progress, resume_hint="`paths claim && paths train` (the path was handed back)",  # signals first: a round's end may wait in `started`
        )
        try:
            result = trainer.fit()
        except diloco.RoundPending as pending:
            return {"path": path_id, "mode": mode, "steps": trainer.step, "tokens": trainer.tokens, "waiting": str(pending), **rejoined(round_sync)}
        summary = {"path": path_id, "mode": mode, "freeze": cfg.freeze, "steps": result.step, "tokens": result.tokens, "final_loss": result.loss, "resumed_from": result.resumed_from, "init": init,
                   **summary_extra, **rejoined(round_sync)}
        # anchored: every shared tensor is still the base's (this stage froze them, and so did the one before)
        summary["anchored"] = cfg.freeze == "shared" and (previous_stage is None or bool(previous_stage.get("anchored")))
        if previous_stage is not None:
            summary["previous_stage"] = previous_stage
        def commit(fence: Callable[[], None]) -> str:
            out = _write_final(run, path_id, trainer.unwrapped, tokenizer, local, cfg, mode, dataset, manifest, summary, fence, lora)
            if rounds is not None:  # the last round's end: published, and the run's composed model if this path was the last one in
                outer = diloco.finish_round(run, path_id, rounds, outer_step, trainer.unwrapped, fence, keeper.lease.worker if keeper else "local",
                                            step=trainer.step, tokens=trainer.tokens, loss=trainer.loss)
                summary["round"] = {"round": rounds.rounds, "outer_step": outer}
            return out

        final = trainer.finish(commit)
        if final is not None:
            summary["final"] = final
        return summary
    finally:
        shutil.rmtree(local, ignore_errors=True)


def rejoined(round_sync: diloco.RoundSync | None) -> dict[str, Any]:
    """The summary's note of DiLoCo rounds this path skipped, made without it while it was dropped."""
    return {"rejoined": round_sync.rejoined} if round_sync is not None and round_sync.rejoined else {}


def _write_final(run: Run, path_id: str, model: torch.nn.Module, tokenizer: Any, local: str, cfg: TrainConfig, mode: str, dataset: str, manifest: dict[str, Any], summary: dict[str, Any],
                 fence: Callable[[], None], lora: LoraSpec | None = None) -> str:
    """work/<path>/final/: the trained dense path (HF format; a LoRA unit's adapter merged into the
    fp32 weights it started from, and the adapter beside them) and its provenance, manifest last."""
    out = os.path.join(local, "final")
    if lora is not None:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        adapter = {k: v.float().contiguous() for k, v in adapter_state(model).items()}
        model = AutoModelForCausalLM.from_pretrained(os.path.join(local, "init"), dtype=torch.float32)
        model.load_state_dict(merge(model.state_dict(), adapter, lora.scale))
        os.makedirs(out, exist_ok=True)
        save_file(adapter, os.path.join(out, ADAPTER_FILE))
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


def check_rounds(run: Run, path_id: str, rounds: diloco.Rounds, mode: str, init: str, cfg: TrainConfig) -> None:
    """What a path of a DiLoCo run may train with: lm or sft from base/, every parameter, one process, R x H steps."""
    if path_id not in rounds.paths:
        raise ConfigurationError(f"{path_id} is not one of the {len(rounds.paths)} paths of {run.url}'s DiLoCo rounds: train it in a run without rounds")
    if mode == "grpo" or init != "base":
        raise ConfigurationError(f"{run.url} trains in DiLoCo rounds, which run --mode lm or sft from base/: train grpo (or --init final) in a run without rounds")
    if cfg.lora_rank or cfg.fsdp or cfg.freeze != "none":
        raise ConfigurationError(f"{run.url} trains in DiLoCo rounds, whose outer step averages every parameter of full, unsharded paths: drop --lora, --fsdp and --freeze")
    if cfg.steps != rounds.total:
        raise ConfigurationError(f"{run.url} trains {rounds.rounds} DiLoCo rounds of {rounds.every} steps: train with --steps {rounds.total} (or leave --steps out)")


def unit_config(run: Run, unit: str, cfg: TrainConfig, steps_given: bool) -> TrainConfig:
    """The config a unit trains with: a domain expert runs its own step budget unless --steps was given."""
    import dataclasses

    from paths.units import step_budget

    rounds = diloco.settings(run)
    if rounds is not None and not steps_given:  # R rounds of H inner steps
        return dataclasses.replace(cfg, steps=rounds.total)
    budget = None if steps_given else step_budget(run, unit)
    return dataclasses.replace(cfg, steps=budget) if budget else cfg
