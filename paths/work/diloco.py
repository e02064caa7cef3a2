"""DiLoCo rounds in place (`paths diloco`): every path trains R rounds of H inner steps, and after
each round its weights are replaced by the round's outer step, with its AdamW state, data position
and schedule kept, as DiLoCo's workers keep their inner optimizers.

    round r of path p:  H steps -> checkpoint -> diloco/r<r>/<p>/ (its weights, fenced by its lease)
    the last path in:   composed/round-<r>/ = outer Nesterov step over every path's delta from the
                        round's start (compose/diloco.py), each module averaged over the paths sharing it
    then every path:    its slice of composed/round-<r>/ becomes its weights; round r + 1 goes on

No coordinator: once every path is in, a worker of the round (whoever publishes the last path,
or one still waiting) computes the outer step, behind a lock written with conditional writes
(diloco/r<r>/outer.json, renewed while computing) so two who race compute it once; if its holder
dies, the lock expires and the paths waiting for the round become claimable again. The outer
step is compose's (compose/diloco.py); a trainer gets it from its caller (`compose.diloco.train`,
which `paths train` runs), as this layer does not import compose. A worker whose
round is not complete waits while other workers hold the missing paths (`round_wait`), and hands
its path back otherwise (claim state `waiting`): it becomes claimable again once the outer step is
there, and the next worker resumes it from the round's checkpoint, exactly. A takeover mid-round
resumes from the newest checkpoint as any path does. A path marked failed is dropped from the
rounds (their outer steps average the others); released again, it skips the rounds made without
it and goes on from the newest outer step, at that round's step of the schedule. The last round's outer step,
composed/round-<R>/, is the run's composed MoE; work/<path>/final/ holds each path's last inner
weights (for `compose --into ensemble`).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from paths.errors import ConfigurationError, NotFound, PathsError
from paths.trainer import Callback, Interrupted
from paths.work.claims import outer_done, round_owed
from storage.layout import Run
from storage.manifest import ArtifactWriter, read_manifest, read_verified

if TYPE_CHECKING:
    from paths.trainer import Trainer

OuterStep = Callable[[Run, int, str], "dict[str, Any] | None"]  # (run, round, worker): compose.diloco.outer_step

POLL = 1.0  # seconds between looks at the store while waiting for a round's outer step


class RoundPending(PathsError):
    """The round's other paths are not in and nobody holds them: the path was handed back
    (`waiting`); claim another."""

    exit_code = 0


@dataclass(frozen=True, slots=True)
class Rounds:
    """run.json's `diloco`: R rounds of H inner steps of every path in `paths`, outer step settings."""

    rounds: int
    every: int
    outer_lr: float
    momentum: float
    paths: tuple[str, ...]

    @property
    def total(self) -> int:
        """Inner steps of a path in all."""
        return self.rounds * self.every

    def ends_round(self, step: int) -> int | None:
        """The round that `step` ends, before the last (whose end is the path's final)."""
        return step // self.every if 0 < step < self.total and step % self.every == 0 else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "paths": list(self.paths)}


def settings(run: Run) -> Rounds | None:
    """The run's rounds, or None when it trains in one round (no `paths diloco`)."""
    spec = run.read_meta().get("diloco")
    return None if spec is None else Rounds(int(spec["rounds"]), int(spec["every"]), float(spec["outer_lr"]), float(spec["momentum"]), tuple(spec["paths"]))


def configure(run: Run, rounds: int, every: int, outer_lr: float = 0.7, momentum: float = 0.9) -> Rounds:
    """Make the run train in `rounds` DiLoCo rounds of `every` inner steps (run.json `diloco`)."""
    from paths.units import decomposed_paths, expert_names

    if rounds < 1 or every < 1:
        raise ConfigurationError(f"--rounds and --inner-steps must be >= 1, got {rounds} and {every}")
    if not 0 <= momentum < 1 or outer_lr <= 0:
        raise ConfigurationError(f"--momentum must be in [0, 1) and --outer-lr > 0, got {momentum} and {outer_lr}")
    _, ids = decomposed_paths(run)
    experts = expert_names(run)
    if experts:
        raise ConfigurationError(f"expert {experts[0]} is a model of its own and shares no module with the paths: DiLoCo rounds average the modules paths share; "
                                 "train the experts in a run without rounds")
    if len(ids) < 2:
        raise ConfigurationError(f"{run.url} has {len(ids)} decomposed path: a round's outer step averages the modules paths share, which needs 2 or more "
                                 f"(`paths decompose {run.url} --levels G --paths all`)")
    if not base_float32(run) and any(f.endswith(".index.json") for f in read_manifest(run.store, run.base)["files"]):
        raise ConfigurationError(f"{run.url}'s base is not float32 and lies in several files: rounds keep their outer steps in float32, "
                                 "which a sharded base cannot be composed into yet; upcycle or init the base in float32")
    started = [o.key for o in run.store.list("claims")] + [o.key for o in run.store.list("work")]
    if started:
        raise ConfigurationError(f"{run.url} is already being trained ({started[0]}): set rounds up before the first claim, or in a new run")
    spec = Rounds(rounds, every, outer_lr, momentum, tuple(ids))
    run.update_meta(diloco=spec.to_json())
    return spec


def round_start(run: Run, r: int) -> str:
    """The checkpoint round r starts from: base/ for the first, else the previous outer step."""
    return run.base if r == 1 else run.composed(f"round-{r - 1}")


def base_float32(run: Run) -> bool:
    """Whether the base's weights are float32 (its config's dtype); rounds are composed in float32."""
    from paths.base import base_config

    config = base_config(run)
    return str(config.get("dtype") or config.get("torch_dtype") or "float32") == "float32"


def publish(run: Run, r: int, path_id: str, weights: dict[str, torch.Tensor], fence: Callable[[], None], **record: Any) -> bool:
    """Commit a path's weights at the end of round r (once: False when they already are)."""
    from safetensors.torch import save

    from paths.checkpoint import unshared

    prefix = run.diloco(r, path_id)
    if published(run, r, path_id):
        return False
    writer = ArtifactWriter(run.store, prefix)
    writer.write("model.safetensors", save(unshared(weights)))
    writer.write("path.json", read_verified(run.store, "paths", f"{path_id}/path.json"))
    writer.write_json("provenance.json", {"path": path_id, "round": r, **record})
    fence()
    writer.commit(kind="diloco-round", path=path_id, round=r)
    return True


def published(run: Run, r: int, path_id: str) -> bool:
    """Whether the path's weights at the end of round r are committed (diloco/r<r>/<path>/)."""
    return run.store.exists(f"{run.diloco(r, path_id)}/manifest.json")


def held(record: dict[str, Any] | None, now: float) -> bool:
    """Whether a claim record is a live lease."""
    return record is not None and record.get("state") == "claimed" and float(record.get("expires_at", 0)) > now


def await_round(run: Run, r: int, spec: Rounds, outer_step: OuterStep, timeout: float, worker: str, stop: Callable[[], bool] = lambda: False) -> bool:
    """Whether round r's outer step is there, computing it when every path is in (and nobody else
    is at it), waiting up to `timeout` seconds while live leases hold the missing paths; False as
    soon as a missing path is held by nobody (the caller should go and train it), or `stop()`."""
    deadline = time.time() + timeout
    while True:
        if outer_done(run, r):
            return True
        _, missing = round_owed(run, r, spec.paths)
        if not missing and outer_step(run, r, worker) is not None:  # computed here, or found made
            return True
        if missing and not all(held(record, time.time()) for record in missing.values()):
            return False
        if time.time() >= deadline or stop():
            return False
        time.sleep(POLL)


def sync(model: torch.nn.Module, run: Run, path_id: str, r: int) -> None:
    """Replace the path's weights by its slice of round r's outer step, in place (the optimizer's
    moments stay attached to the same parameters)."""
    from safetensors.torch import load_file

    from paths.models import materialize

    with tempfile.TemporaryDirectory(prefix=f"paths-round-{path_id}-") as tmp:
        materialize(run, path_id, tmp, source=run.composed(f"round-{r}"))
        values = load_file(os.path.join(tmp, "model.safetensors"))
    state = model.state_dict()
    unknown = sorted(set(values) - set(state))
    if unknown:
        raise ConfigurationError(f"composed/round-{r}/ gives path {path_id} a tensor {unknown[0]} its model lacks: the run's family does not match the model being trained")
    covered = {state[k].untyped_storage().data_ptr() for k in values}
    missed = [n for n, p in model.named_parameters() if p.untyped_storage().data_ptr() not in covered]
    if missed:
        raise ConfigurationError(f"composed/round-{r}/ holds no value for {missed[0]} of path {path_id}: the run's family does not match the model being trained")
    with torch.no_grad():
        for k, v in values.items():
            state[k].copy_(v)


class RoundSync(Callback):
    """The trainer's side of a round's end: checkpoint, publish, the outer step (if this path was
    the last one in), then either the new weights or the path handed back (`waiting`)."""

    def __init__(self, run: Run, path_id: str, spec: Rounds, outer_step: OuterStep, keeper: Any, wait: float):
        """`keeper`: the lease's callback (paths.work.train.LeaseKeeper: `lease`, `hand_back`), or None."""
        self.run, self.path, self.spec, self.outer_step, self.keeper, self.wait = run, path_id, spec, outer_step, keeper, wait
        self.rejoined: dict[str, Any] | None = None  # the rounds made without this path, when it came back (see `started`)

    def started(self, trainer: Trainer) -> None:
        done = trainer.step // self.spec.every  # rounds this path trained to their end
        newest = done
        while newest < self.spec.rounds and outer_done(self.run, newest + 1) and not published(self.run, newest + 1, self.path):
            newest += 1  # (a round it published, it retrains exactly: a takeover after its last round's publish keeps its own final)
        if newest > done:  # outer steps made without it (it was marked failed, then released): its work in them is past use
            sync(trainer.unwrapped, self.run, self.path, newest)  # it starts from the newest one, with its AdamW state and data position
            trainer.step = newest * self.spec.every  # the schedule with it (the trainer's scheduler follows a moved step)
            self.rejoined = {"rounds_skipped": list(range(done + 1, newest + 1)), "from": f"composed/round-{newest}", "at_step": trainer.step}
        elif self.spec.ends_round(trainer.step):  # resumed from a round's end, before its sync
            self._end_round(trainer)

    def stepped(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.spec.ends_round(trainer.step):
            self._end_round(trainer)

    def _end_round(self, trainer: Trainer) -> None:
        r = trainer.step // self.spec.every
        if trainer.saved_at != trainer.step:
            trainer.save_checkpoint()
        model = trainer.unwrapped
        publish(self.run, r, self.path, model.state_dict(), trainer.fence, step=trainer.step, tokens=trainer.tokens, loss=trainer.loss)
        worker = self.keeper.lease.worker if self.keeper else "local"
        stop = trainer.stop
        if not await_round(self.run, r, self.spec, self.outer_step, self.wait, worker, lambda: stop.signal is not None or stop.lost is not None):
            if stop.lost is not None:
                raise stop.lost  # somebody else holds the path: write nothing more
            if self.keeper is not None:
                self.keeper.hand_back("waiting", round=r, step=trainer.step, committed_step=trainer.step)
            if stop.signal is not None:
                raise Interrupted(f"stopped by {signal.Signals(stop.signal).name} while path {self.path} waited for round {r}'s outer step: checkpoint {trainer.step} committed, "
                                  "the path handed back (waiting); resume: `paths claim && paths train`")
            raise RoundPending(f"path {self.path} finished round {r} of {self.spec.rounds}; the round's other paths are not in: handed back until composed/round-{r}/ exists")
        sync(model, self.run, self.path, r)


def finish_round(run: Run, path_id: str, spec: Rounds, outer_step: OuterStep, model: torch.nn.Module, fence: Callable[[], None], worker: str, **record: Any) -> dict[str, Any] | None:
    """The last round's end (inside the final commit): publish, and the run's composed model if
    this path was the last one in."""
    publish(run, spec.rounds, path_id, model.state_dict(), fence, **record)
    return outer_step(run, spec.rounds, worker)


def status(run: Run) -> dict[str, Any] | None:
    """Round by round: paths in, outer step done and the paths it averaged (for `paths diloco`);
    the paths marked failed, dropped from the rounds."""
    spec = settings(run)
    if spec is None:
        return None
    out = []
    for r in range(1, spec.rounds + 1):
        ins, owed = round_owed(run, r, spec.paths)
        done = outer_done(run, r)
        out.append({"round": r, "paths_in": len(ins), "outer_step": done, **({"averaged": sorted(outer_record(run, r)["paths"])} if done else {})})
        if not ins:
            break
    dropped = sorted(set(spec.paths) - ins - set(owed))  # failed: the rounds go on without them
    return {**spec.to_json(), "paths": len(spec.paths), "rounds_done": sum(x["outer_step"] for x in out), "progress": out, **({"dropped": dropped} if dropped else {})}


def outer_record(run: Run, r: int) -> dict[str, Any]:
    """composed/round-<r>/compose.json."""
    try:
        return json.loads(read_verified(run.store, run.composed(f"round-{r}"), "compose.json"))
    except NotFound:
        raise NotFound(f"round {r}'s outer step is not computed yet in {run.url}: see `paths diloco {run.url}`") from None

