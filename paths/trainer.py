"""The one training loop: every unit that learns (a path by lm, sft or grpo; a composed MoE's
routers) runs through `Trainer.fit`, so all of them resume, checkpoint, log and stop alike.

The loop owns the optimizer (AdamW, decay on matrices), the warmup + cosine schedule, clipping,
resume (weights, optimizer, data position, RNG, metrics), the metrics JSON lines, progress and the
checkpoint cadence (every N steps and every M minutes). What varies is declared:
- a `Step` computes one optimizer step's gradients from the batches (`grad_accum` micro-batches,
  a rollout, ...) and says between which steps a checkpoint may fall;
- `Batches` hand out batches and save and restore their position;
- `Callback`s hook in: the lease heartbeat and fencing of a claimed path, signal handling.

A stop request (a lost lease, a signal) is agreed by every rank through an all-reduce each step:
a lost lease stops without writing; a signal commits a checkpoint first, then raises Interrupted.
Only rank 0 writes to the run.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, TypeVar

import torch

from paths import checkpoint, fsdp
from paths.adapters import adapter_state, is_adapted, load_adapter_state
from paths.allocator import keep_freed_memory
from paths.errors import ConfigurationError, LeaseLost, PathsError
from paths.threads import Threads
from paths.train_config import TrainConfig
from storage.layout import Run

T = TypeVar("T")


class Interrupted(PathsError):
    """Stopped by a signal after committing a checkpoint."""

    exit_code = 143


class Step(Protocol):
    """One optimizer step's gradients: calls `acc.backward` on its losses and returns at least
    `loss` and `tokens` (the step's targets, counted once per rank)."""

    checkpoint_multiple: int  # a checkpoint falls only on steps divisible by this (grpo: a rollout's iterations)

    def __call__(self, model: torch.nn.Module, acc: Any, batches: "Batches") -> dict[str, float]: ...


class Batches(Protocol):
    """An endless batch iterator whose position is saved in every checkpoint."""

    def __next__(self) -> dict[str, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(slots=True)
class Stop:
    """Why the loop must stop, set from a heartbeat thread or a signal handler."""

    lost: LeaseLost | None = None
    signal: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class Callback:
    """Hooks of the loop; each does nothing unless overridden. `trainer.stop` is theirs to set."""

    def started(self, trainer: "Trainer") -> None:
        """After resume, before the first step."""

    def stepped(self, trainer: "Trainer", record: dict[str, Any]) -> None:
        """After each optimizer step, with its metrics record."""

    def fence(self, trainer: "Trainer") -> None:
        """Right before anything is committed to the run: raise to refuse the commit."""

    def committed(self, trainer: "Trainer", step: int) -> None:
        """After a checkpoint at `step` was committed."""

    def interrupted(self, trainer: "Trainer", step: int, signal_name: str) -> None:
        """After the checkpoint a signal asked for was committed, before Interrupted is raised."""

    def finished(self, trainer: "Trainer") -> None:
        """After the caller committed the unit's result."""

    def close(self) -> None:
        """Always, last (success or not)."""

    def state(self) -> dict[str, Any]:
        """Fields this callback adds to every checkpoint's state.json."""
        return {}

    def postfix(self) -> dict[str, str]:
        """Fields this callback adds to the progress bar."""
        return {}


class Signals(Callback):
    """SIGTERM / SIGINT ask the loop to checkpoint and stop (from the main thread only)."""

    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}

    def started(self, trainer: "Trainer") -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in (signal.SIGTERM, signal.SIGINT):
            self.previous[s] = signal.getsignal(s)
            signal.signal(s, lambda signum, frame: setattr(trainer.stop, "signal", signum))

    def close(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous.clear()


class Tracking(Callback):
    """Copies each step's metrics to the tracker of cfg.report_to (paths/tracking.py; the
    accelerator was made by `tracking.accelerator` with it): starts it with the training config,
    logs every numeric metric at its step, ends it when the trainer closes. The run's folder name is
    the project, the unit (path, expert, moe-NAME) the tracker's run. The trainer adds it itself."""

    def __init__(self, run_name: str, report_to: str, logging_dir: str):
        self.run_name, self.report_to, self.logging_dir = run_name, report_to, logging_dir
        self.acc: Any = None

    def started(self, trainer: "Trainer") -> None:
        if self.acc is not None:
            return
        self.acc = trainer.acc
        unit = trainer.unit
        config = {**trainer.cfg.to_json(), **trainer.job, "unit": unit, "run": trainer.run.url}
        if self.report_to == "tensorboard":  # one folder per unit: logging_dir/<run>/<unit>
            project, kwargs = f"{self.run_name}/{unit}", {}
        elif self.report_to == "wandb":
            project, kwargs = self.run_name, {"wandb": {"name": unit, "dir": self.logging_dir, "mode": os.environ.get("WANDB_MODE", "offline")}}
        else:
            if not os.environ.get("MLFLOW_TRACKING_URI"):
                import mlflow

                mlflow.set_tracking_uri("sqlite:///" + os.path.abspath(os.path.join(self.logging_dir, "mlflow.db")))  # MLflow 3 keeps the file store for old runs only
            project, kwargs = self.run_name, {"mlflow": {"run_name": unit}}
        self.acc.init_trackers(project, config={k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))}, init_kwargs=kwargs)

    def stepped(self, trainer: "Trainer", record: dict[str, Any]) -> None:
        values = {k: v for k, v in record.items() if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.acc.log(values, step=record["step"])

    def close(self) -> None:
        if self.acc is not None:
            self.acc.end_training()
            self.acc = None


@dataclass(slots=True)
class Result:
    """What a fit did: the step it resumed from, the step, tokens and loss it ended at."""

    resumed_from: int
    step: int
    tokens: int
    loss: float | None


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to 1, then cosine down to min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, with weight decay on matrices only (not on norms and
    biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernel (CPU and CUDA) does the whole update in one pass per tensor.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)


def rng_state() -> dict[str, Any]:
    """torch's global RNG state (and every CUDA device's), as hex strings for state.json."""
    state: dict[str, Any] = {"torch": torch.get_rng_state().numpy().tobytes().hex()}
    if torch.cuda.is_available():
        state["cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` saved."""
    torch.set_rng_state(torch.frombuffer(bytearray(bytes.fromhex(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(bytes.fromhex(s)), dtype=torch.uint8) for s in state["cuda"]])


def read_metrics(run: Run, unit: str) -> list[dict[str, Any]]:
    """work/<unit>/metrics.jsonl, one record per optimizer step ([] before the first commit)."""
    key = f"{run.work(unit)}/metrics.jsonl"
    if not run.store.exists(key):
        return []
    return [json.loads(line) for line in run.store.read(key).decode().splitlines() if line.strip()]


class Trainer:
    """Fit `model` to cfg.steps with `step` over `batches`, checkpointing under work/<unit>/.

    `job` names what is trained (mode, dataset, ...): a checkpoint is resumed only when its
    state.json matches every field, and each checkpoint records them. `resume_hint` ends the
    message of an interruption (the command that resumes).
    """

    def __init__(
        self,
        run: Run,
        unit: str,
        job: dict[str, Any],
        cfg: TrainConfig,
        model: torch.nn.Module,
        step: Step,
        batches: Batches,
        acc: Any,
        *,
        callbacks: Iterable[Callback] = (),
        desc: str = "train",
        show_progress: bool = True,
        resume_hint: str = "run the same command again",
    ):
        self.run, self.unit, self.job, self.cfg = run, unit, dict(job), cfg
        self.model, self.step_fn, self.batches, self.acc = model, step, batches, acc
        self.callbacks = list(callbacks)
        if cfg.report_to != "none":
            self.callbacks.append(Tracking(run.url.rstrip("/").rsplit("/", 1)[-1], cfg.report_to, cfg.logging_dir))
        self.desc, self.show_progress, self.resume_hint = desc, show_progress, resume_hint
        self.stop = Stop()
        self.fsdp = cfg.fsdp
        if self.fsdp:  # sharded before the optimizer sees the parameters: its moments are sharded too
            if acc.num_processes < 2:
                raise ConfigurationError("--fsdp shards a path over several processes: launch N of them (torchrun --nproc-per-node N, accelerate launch --num-processes N), or drop --fsdp")
            fsdp.shard(model, bf16=acc.mixed_precision == "bf16")  # its own autocast: accelerate's wraps a prepared model only
        self.plain: torch.nn.Module | None = None  # FSDP: the whole model on rank 0, gathered to commit
        self.optimizer = make_optimizer(model, cfg)
        self.step, self.tokens, self.loss = 0, 0, None
        self.saved_at = -1  # the step of the newest checkpoint committed or resumed from
        self.metrics: list[dict[str, Any]] = []
        self.main = acc.is_main_process
        self.threads = Threads()  # on a CPU: torch's threads kept to the cores other processes leave free
        if acc.device.type == "cpu":
            keep_freed_memory()  # large tensors from the heap, not an mmap() each step (paths/allocator.py)

    # -- the loop ---------------------------------------------------------------------------------
    def fit(self) -> Result:
        """Resume if a checkpoint of this job exists, then step to cfg.steps; callbacks closed
        on the way out whatever happens."""
        try:
            return self._fit()
        except BaseException:
            self.close()
            raise

    def _fit(self) -> Result:
        cfg, acc = self.cfg, self.acc
        start = self._resume()
        if not self.fsdp:  # FSDP2 syncs gradients itself: no DDP wrapper
            self.model, self.optimizer = acc.prepare(self.model, self.optimizer)
        for cb in self.callbacks:
            cb.started(self)
        for group in self.optimizer.param_groups:  # a fresh optimizer's; a resumed one saved its own
            group.setdefault("initial_lr", group["lr"])
        # the schedule where the loop starts: resumed, or moved on by a callback (a DiLoCo path skipping rounds made without it)
        scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, cfg), last_epoch=self.step - 1)
        multiple = self.step_fn.checkpoint_multiple
        bar = _progress(self.show_progress and self.main, self.step, cfg.steps, f"{self.desc} {self.unit}")
        last_ckpt_time, t0, tokens_at_t0 = time.time(), time.time(), self.tokens
        self.model.train()
        while self.step < cfg.steps:
            self._check_stop()
            if acc.device.type == "cpu":
                self.threads.check()
            stats = self.step_fn(self.model, acc, self.batches)  # gradients of one optimizer step
            if cfg.max_grad_norm > 0:
                acc.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            self.optimizer.step()
            scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.tokens += int(stats.pop("tokens")) * acc.num_processes
            self.loss = stats["loss"]
            rate = (self.tokens - tokens_at_t0) / max(1e-9, time.time() - t0)  # since this process started
            record = {"step": self.step, **stats, "lr": scheduler.get_last_lr()[0], "tokens": self.tokens, "tokens_per_s": rate, "time": time.time()}
            self.metrics.append(record)
            for cb in self.callbacks:
                cb.stepped(self, record)
            bar.update(1)
            bar.set_postfix(loss=f"{self.loss:.3f}", tok_s=f"{rate:,.0f}", **{k: v for cb in self.callbacks for k, v in cb.postfix().items()})
            due = (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or ranks_agree(acc, time.time() - last_ckpt_time > cfg.checkpoint_minutes * 60, "any")
            between = self.step % multiple == 0  # grpo: not inside a rollout's iterations
            if due and between and self.step < cfg.steps and self.saved_at != self.step:
                self.save_checkpoint()
                last_ckpt_time = time.time()
            if self.stop.lost is not None or (self.stop.signal is not None and between):
                self._check_stop(save=True)
        bar.close()
        self._check_stop()
        return Result(start, self.step, self.tokens, self.loss)

    def _resume(self) -> int:
        resumed = checkpoint.load_latest(self.run, self.unit, self.job)
        if resumed is None:
            return 0
        start, model_sd, opt_sd, state = resumed
        if self.fsdp:
            fsdp.load(self.model, self.optimizer, model_sd, checkpoint.optimizer_state(opt_sd, state["optimizer"]))
        elif is_adapted(self.model):
            load_adapter_state(self.model, model_sd, f"checkpoint {start} of {self.unit}")
        else:
            self.model.load_state_dict(model_sd)
        if not self.fsdp:
            checkpoint.load_optimizer(self.optimizer, opt_sd, state["optimizer"])
        data, rng, rank = state["data"], state["rng"], self.acc.process_index
        if (len(data) if isinstance(data, list) else 1) != self.acc.num_processes:  # written by another number of ranks: the same global position, split anew
            data, rng = _resharded(data, self.acc.num_processes, rank, f"checkpoint {start} of {self.unit}"), rng[0] if isinstance(rng, list) else rng
        self.batches.load_state_dict(data[rank] if isinstance(data, list) else data)
        set_rng_state(rng[rank] if isinstance(rng, list) else rng)  # one state per rank under DDP
        self.step, self.tokens, self.loss, self.saved_at = start, state["tokens"], state["loss"], start
        saved = checkpoint.read_file(self.run, self.unit, start, "metrics.jsonl")  # the checkpoint's own: a kill after COMMITTED loses none
        metrics = [json.loads(line) for line in saved.decode().splitlines() if line.strip()] if saved is not None else read_metrics(self.run, self.unit)
        self.metrics = [m for m in metrics if m["step"] <= start]
        return start

    # -- committing -------------------------------------------------------------------------------
    def fence(self) -> None:
        """Ask every callback whether we may still write (a lease that moved on refuses)."""
        for cb in self.callbacks:
            cb.fence(self)

    def save_checkpoint(self) -> None:
        """Commit work/<unit>/ckpt-<step>/ (rank 0), the metrics so far, and prune old ones."""
        data = self.batches.state_dict()
        if self.acc.num_processes > 1:  # every rank consumed the same number of windows: checked, then one state per rank
            mine = torch.tensor([zlib.crc32(json.dumps(_without_rank(data), sort_keys=True).encode())], device=self.acc.device)
            if len(set(self.acc.gather(mine).tolist())) > 1:
                raise PathsError(f"the ranks of {self.desc} {self.unit} drew different numbers of batches by step {self.step}: a step must draw the same on every rank")
            data = [{**data, "rank": r} for r in range(self.acc.num_processes)]
        rng = rng_state() if self.acc.num_processes == 1 else _gather_objects(rng_state())  # every rank's sampler resumes exactly
        state = {
            **self.job, "step": self.step, "tokens": self.tokens, "loss": self.loss, "config": self.cfg.to_json(),
            "data": data, "rng": rng, **{k: v for cb in self.callbacks for k, v in cb.state().items()},
        }
        if self.fsdp:
            weights, optim = fsdp.gather(self.model, self.optimizer)  # every rank takes part; rank 0 holds the whole
        else:
            model = self.acc.unwrap_model(self.model)
            weights = adapter_state(model) if is_adapted(model) else model.state_dict()  # a LoRA unit's base is re-read on resume
            optim = self.optimizer.state_dict()
        failed: Exception | None = None
        if self.main:
            try:
                checkpoint.save(self.run, self.unit, self.step, weights, optim, state, self.fence, files={"metrics.jsonl": self._metrics_bytes()})
                self.write_metrics()
                checkpoint.prune(self.run, self.unit, self.cfg.keep_checkpoints)
                for cb in self.callbacks:
                    cb.committed(self, self.step)
            except Exception as exc:  # a lost lease, the store: every rank stops, not rank 0 alone
                failed = exc
        self._agree(failed, f"checkpoint {self.step}")
        self.saved_at = self.step

    def write_metrics(self) -> None:
        """work/<unit>/metrics.jsonl: one JSON line per optimizer step, resumed runs included."""
        self.run.store.write(f"{self.run.work(self.unit)}/metrics.jsonl", self._metrics_bytes())

    def _metrics_bytes(self) -> bytes:
        return "".join(json.dumps(m) + "\n" for m in self.metrics).encode()

    def finish(self, commit: Callable[[Callable[[], None]], T]) -> T | None:
        """After `fit`: rank 0 commits the result with `commit(fence)`, writes the metrics and tells
        the callbacks; returns what `commit` returned (None on other ranks). Closes the callbacks."""
        try:
            if self.fsdp:  # the whole model, gathered to rank 0, is what rank 0 commits
                weights, _ = fsdp.gather(self.model)
                failed: Exception | None = None
                if self.main:
                    try:
                        from transformers import AutoModelForCausalLM

                        self.plain = AutoModelForCausalLM.from_config(self.model.config, dtype=torch.float32)
                        self.plain.load_state_dict(weights)
                    except Exception as exc:
                        failed = exc
                self._agree(failed, "the final weights")  # every rank takes part: the barrier
            else:
                self.acc.wait_for_everyone()
            if not self.main:
                return None
            out = commit(self.fence)
            self.write_metrics()
            for cb in self.callbacks:
                cb.finished(self)
            return out
        finally:
            self.close()

    def _agree(self, failed: Exception | None, what: str) -> None:
        """Rank 0's failure (`failed`) raised on every rank, so none waits in a collective that rank 0
        never reaches: rank 0 raises its own error, the others one line pointing at it."""
        if not ranks_agree(self.acc, failed is not None, "any"):
            return
        if failed is not None:
            raise failed
        raise PathsError(f"rank 0 could not write {what} of {self.desc} {self.unit}: its error says why; every rank stops")

    def close(self) -> None:
        """Close every callback (heartbeats stop, signal handlers are restored)."""
        for cb in self.callbacks:
            cb.close()

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The model without the accelerator's wrapper (to save or evaluate); FSDP's, whole, after `finish` gathered it."""
        return self.plain if self.plain is not None else self.acc.unwrap_model(self.model)

    def _check_stop(self, save: bool = False) -> None:
        """All ranks stop together: on a lost lease without writing; on a signal after a checkpoint."""
        flags = torch.tensor([self.stop.lost is not None, self.stop.signal is not None], dtype=torch.int64, device=self.acc.device)  # NCCL reduces device tensors only
        if self.acc.num_processes > 1:
            flags = self.acc.reduce(flags, reduction="sum")
        if flags[0]:
            raise self.stop.lost or LeaseLost("rank 0 lost the lease: stopping without writing")
        if flags[1] and save:
            if self.saved_at != self.step:  # (a DiLoCo round's end committed this step already)
                self.save_checkpoint()
            name = signal.Signals(self.stop.signal or signal.SIGTERM).name
            if self.main:
                for cb in self.callbacks:
                    cb.interrupted(self, self.step, name)
            raise Interrupted(f"stopped by {name} at step {self.step} of {self.desc} {self.unit}: checkpoint committed; resume: {self.resume_hint}")


def ranks_agree(acc: Any, flag: bool, how: str = "all") -> bool:
    """`flag` agreed by every rank: true when it holds on all of them (`all`) or on any (`any`), so
    every rank takes the same branch and reaches the same collectives."""
    if acc.num_processes == 1:
        return flag
    holding = int(acc.reduce(torch.tensor([int(flag)], device=acc.device), reduction="sum").item())
    return holding == acc.num_processes if how == "all" else holding > 0


def _gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _resharded(data: Any, world: int, rank: int, what: str) -> dict[str, Any]:
    """One rank's data state out of a checkpoint written by another number of ranks. Rank r of W
    reads windows r, r+W, ... of each epoch's global order, so W ranks at one position have read a
    prefix of the global order: exact as long as no rank has wrapped into an epoch of another
    length (an epoch of n windows gives every rank n/W when W divides n), before or after."""
    states = data if isinstance(data, list) else [data]
    fields = {"rank", "world_size", "position"}
    if any(set(s) - fields != set(states[0]) - fields or "position" not in s or "windows" not in s for s in states):
        raise ConfigurationError(f"{what} was written by {len(states)} ranks and its data state does not split by position: resume with {len(states)} ranks")
    old, n = len(states), int(states[0]["windows"])
    consumed = sum(int(s["position"]) for s in states)
    if consumed % world:
        raise ConfigurationError(f"{what} was written by {old} ranks after {consumed} windows, which {world} ranks cannot split evenly: resume with a number of ranks dividing {consumed}")
    for ranks in (old, world):
        if consumed > ranks * (n // ranks) and n % ranks:
            raise ConfigurationError(f"{what} was written by {old} ranks after {consumed} windows, past an epoch of {n} that {ranks} ranks do not split evenly: resume on as many ranks as wrote it ({old})")
    return {**states[0], "rank": rank, "world_size": world, "position": consumed // world}


def _without_rank(state: Any) -> Any:
    """A data state with every `rank` field dropped (what must agree across ranks)."""
    if isinstance(state, dict):
        return {k: _without_rank(v) for k, v in state.items() if k != "rank"}
    return state


def _progress(enabled: bool, start: int, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc=desc, unit="step", disable=not enabled or None)
