"""A DiLoCo round's outer step (paths/work/diloco.py runs the rounds): composed/round-<r>/.

For every tensor, the paths containing it give deltas from the round's start (base/ for round 1,
composed/round-<r-1>/ after), averaged over those paths only (an expert over the paths through it,
shared tensors over all), then the outer Nesterov step of `compose.merge` with the run's outer lr
and momentum (the momentum continues from composed/round-<r-1>/momentum.safetensors). The output
holds per-tensor sha256s, so each path's next round is cut from it by checked ranged reads.

Computed once without a coordinator: the worker that wants it takes diloco/r<r>/outer.json with
a create-only write (an expired one by a conditional write), renews it right before installing
(a worker that lost it installs nothing), and the composed model's manifest is written last. A
second call finds it and returns it, after checking it was made from the same paths' weights.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from paths.errors import ConfigurationError, IntegrityError, NotFound, PathsError, PreconditionFailed
from paths.work.claims import round_owed
from paths.work.diloco import base_float32, outer_done, outer_record, round_start, settings
from storage.layout import Run

TTL = 120.0  # seconds the outer step's lock lasts; renewed every TTL/3 while computing, so only a dead holder loses it


def train(run: Run, path_id: str, mode: str, dataset: str, cfg: Any, lease: Any, **options: Any) -> dict[str, Any]:
    """`paths train` of any unit (`paths.work.train.train` and its options), with the outer step
    that a DiLoCo run's workers compute when they finish a round's last path."""
    from paths.work.train import train as train_unit

    return train_unit(run, path_id, mode, dataset, cfg, lease, outer_step=outer_step, **options)


def outer_step(run: Run, r: int, worker: str = "local", ttl: float = TTL) -> dict[str, Any] | None:
    """Round r's outer step: computed here if every path is in and nobody else is at it, or found.
    Returns its record ({round, computed, checksums...}), or None when paths are missing or
    another worker is computing it."""
    from compose.merge import execute
    from compose.plan import plan_compose

    spec = settings(run)
    if spec is None:
        raise NotFound(f"{run.url} does not train in DiLoCo rounds: set them up with `paths diloco {run.url} --rounds R --inner-steps H`")
    if not 1 <= r <= spec.rounds:
        raise IntegrityError(f"{run.url} trains {spec.rounds} DiLoCo rounds; there is no round {r}")
    if outer_done(run, r):
        return _agreed(run, r, computed=False)
    members, owed = round_owed(run, r, spec.paths)
    if owed or not members:  # a path still to come (a failed one is dropped from the round)
        return None
    if r > 1 and not outer_done(run, r - 1):
        raise IntegrityError(f"round {r} of {run.url} is complete but round {r - 1}'s outer step is missing: its paths could not have started round {r}; restore composed/round-{r - 1}/")
    lock = Lock(run, r, worker, ttl)
    if not lock.take():
        return _agreed(run, r, computed=False) if outer_done(run, r) else None
    if outer_done(run, r):  # installed by the holder whose lock we just took over as it finished
        lock.release()
        return _agreed(run, r, computed=False)
    keep = threading.Event()
    beat = threading.Thread(target=lock.keep, args=(keep,), daemon=True, name="paths-outer-lock")
    beat.start()  # renewed while computing: a slow computation is not taken over, a dead one is
    try:
        plan = plan_compose(run, f"round-{r}", paths=sorted(members), outer_lr=spec.outer_lr, momentum=spec.momentum,
                            previous=f"round-{r - 1}" if r > 1 and spec.momentum > 0 else None, base=round_start(run, r), weights=lambda p: run.diloco(r, p),
                            dtype=None if base_float32(run) else "float32")  # rounds in fp32: a bf16 base would round every outer step away
        execute(run, plan, fence=lock.renew, tensor_hashes=True)
    except (PreconditionFailed, ConfigurationError) as exc:  # the lock was taken over, or its new holder installed first
        if outer_done(run, r):
            return _agreed(run, r, computed=False)
        if isinstance(exc, PreconditionFailed):
            return None  # the lock's new holder computes it
        raise
    finally:
        keep.set()
        beat.join()
    lock.release()
    return _agreed(run, r, computed=True)


def _agreed(run: Run, r: int, computed: bool) -> dict[str, Any]:
    """The outer step's record, checked against the paths' published weights: a second computation
    is a no-op only if the first was made from the same inputs."""
    from compose.plan import trained_path

    record = outer_record(run, r)
    base = run.read_meta()["base"]["checksum"]
    for pid, entry in record["paths"].items():
        mine = trained_path(run, pid, base, "uniform", run.diloco(r, pid)).checksum
        if mine != entry["final_checksum"]:
            raise IntegrityError(f"composed/round-{r}/ was computed from other weights of path {pid} than diloco/r{r}/{pid}/ holds: "
                                 f"the round was published twice; delete composed/round-{r}/ and run `paths diloco {run.url} --step`")
    return {"round": r, "computed": computed, "paths": len(record["paths"]), "outer_lr": record["options"]["outer_lr"], "momentum": record["options"]["momentum"],
            "start": record.get("start"), "seconds": record.get("seconds")}


class Lock:
    """diloco/r<r>/outer.json: who computes round r's outer step, until when."""

    def __init__(self, run: Run, r: int, worker: str, ttl: float):
        self.run, self.r, self.worker, self.ttl = run, r, worker, ttl
        self._lock = threading.Lock()
        self.key = f"{run.diloco(r)}/outer.json"
        self.etag: str | None = None
        self.generation = 0

    def _record(self, state: str) -> bytes:
        now = time.time()
        return json.dumps({"round": self.r, "worker": self.worker, "state": state, "generation": self.generation, "at": now, "expires_at": now + self.ttl}).encode()

    def take(self) -> bool:
        """Ours now (create-only, or a takeover of an expired one), or False."""
        store = self.run.store
        try:
            self.generation = 1
            self.etag = store.put_if_absent(self.key, self._record("computing"))
            return True
        except PreconditionFailed:
            pass
        try:
            data, etag = store.read_with_etag(self.key)
            held = json.loads(data)
        except NotFound:
            return False
        except ValueError:
            held = {}
        if held.get("state") == "computing" and float(held.get("expires_at", 0)) > time.time():
            return False  # another worker is at it
        if held.get("state") == "done" and outer_done(self.run, self.r):
            return False
        self.generation = int(held.get("generation", 0)) + 1
        try:
            self.etag = store.put_if_match(self.key, self._record("computing"), etag)
        except (PreconditionFailed, NotFound):
            return False
        return True

    lost: Exception | None = None

    def renew(self) -> None:
        """Right before the install (and every ttl/3 meanwhile): raises PreconditionFailed if
        another worker took it over."""
        if self.lost is not None:
            raise self.lost
        with self._lock:
            try:
                self.etag = self.run.store.put_if_match(self.key, self._record("computing"), self.etag)
            except (PreconditionFailed, NotFound):
                self.lost = PreconditionFailed(f"{self.run.store.url_of(self.key)} was taken over by another worker: this one installs nothing")
                raise self.lost from None

    def keep(self, done: threading.Event) -> None:
        """Renew every ttl/3 until `done` (a thread's loop; a lost lock is kept in `lost`)."""
        while not done.wait(self.ttl / 3):
            try:
                self.renew()
            except PreconditionFailed:
                return
            except PathsError:
                pass  # a transient storage error: the next renewal is well before expiry

    def release(self) -> None:
        if self.lost is not None:
            return
        try:
            self.run.store.put_if_match(self.key, self._record("done"), self.etag)
        except (PreconditionFailed, NotFound):
            pass  # the composed model is committed: the record is only a note
