"""Claims: workers coordinate through the store alone, with conditional writes (DESIGN.md, Claims).

A path's record `claims/<path>.json` moves through states:

    (absent) --claim: If-None-Match *--> claimed --done--> done
                                   |  ^                --fail--> failed
               renew: If-Match --- +  | takeover of an expired lease: If-Match, generation + 1
    claimed --release (admin) / handoff on SIGTERM--> open --claim: If-Match--> claimed

Every change is a compare-and-swap on the record's etag, so of two writers exactly one wins; a
holder whose renewal is refused (412) has lost the lease and must stop writing (fencing).
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from paths.errors import ConfigurationError, LeaseLost, NothingToClaim, NotFound, PreconditionFailed
from storage.layout import Run

STATES = ("claimed", "done", "failed", "open")


def default_worker() -> str:
    """hostname-<random>: unique per `paths claim`, kept in the local claim file."""
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


def _dump(record: dict[str, Any]) -> bytes:
    return json.dumps(record, indent=2, sort_keys=True).encode() + b"\n"


@dataclass(slots=True)
class Lease:
    """A claim this worker holds: the record as last written, and its etag."""

    run: Run
    path: str
    worker: str
    ttl: float
    etag: str
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def generation(self) -> int:
        return int(self.record["generation"])

    def time_left(self, now: float | None = None) -> float:
        return float(self.record["expires_at"]) - (now or time.time())

    def _swap(self, record: dict[str, Any], what: str) -> None:
        try:
            self.etag = self.run.store.put_if_match(self.run.claim(self.path), _dump(record), self.etag)
        except (PreconditionFailed, NotFound):
            raise LeaseLost(
                f"lost the lease on {self.path} (generation {self.generation}) while trying to {what}: another "
                "worker took it over or an admin released it; nothing more was written"
            ) from None
        self.record = record

    def renew(self, **progress: Any) -> None:
        """Extend the lease by its TTL (compare-and-swap); LeaseLost if someone else holds it."""
        now = time.time()
        self._swap({**self.record, **progress, "renewed_at": now, "expires_at": now + self.ttl}, "renew it")

    def finish(self, state: str, **fields: Any) -> None:
        """Set a final state (done / failed / open for a handoff), if we still hold the lease."""
        if state not in STATES:
            raise ConfigurationError(f"unknown claim state {state!r}: use one of {', '.join(STATES)}")
        self._swap({**self.record, **fields, "state": state, "finished_at": time.time()}, f"mark it {state}")

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run.url, "path": self.path, "worker": self.worker, "ttl": self.ttl, "etag": self.etag, "generation": self.generation}


def read_claim(run: Run, path: str) -> tuple[dict[str, Any] | None, str | None]:
    """(record, etag) of a path's claim, or (None, None) when nobody ever claimed it."""
    try:
        data, etag = run.store.read_with_etag(run.claim(path))
    except NotFound:
        return None, None
    return json.loads(data), etag


def claimable(record: dict[str, Any] | None, now: float) -> bool:
    """Nobody claimed it, it was released, or its holder's lease expired."""
    if record is None:
        return True
    state = record.get("state")
    return state == "open" or (state == "claimed" and float(record.get("expires_at", 0)) < now)


def claim(run: Run, paths: list[str], *, ttl: float = 600, worker: str | None = None, rng: random.Random | None = None) -> Lease:
    """Claim one of `paths`: the first claimable one from a random starting point (so racing
    workers rarely collide), by create-only put or by takeover of an expired / released record."""
    if ttl <= 0:
        raise ConfigurationError(f"--ttl must be > 0 seconds, got {ttl}")
    worker = worker or default_worker()
    start = (rng or random.Random()).randrange(len(paths)) if paths else 0
    for path in paths[start:] + paths[:start]:
        record, etag = read_claim(run, path)
        now = time.time()
        if not claimable(record, now):
            continue
        new = {
            "path": path, "state": "claimed", "worker": worker, "ttl": ttl,
            "generation": 1 if record is None else int(record.get("generation", 0)) + 1,
            "claimed_at": now, "renewed_at": now, "expires_at": now + ttl,
        }
        if record is not None:
            new["previous"] = {k: record.get(k) for k in ("worker", "state", "generation", "expires_at")}
            for k in ("step", "tokens", "loss", "committed_step"):
                if k in record:
                    new[k] = record[k]
        try:
            if record is None:
                new_etag = run.store.put_if_absent(run.claim(path), _dump(new))
            else:
                new_etag = run.store.put_if_match(run.claim(path), _dump(new), etag)
        except (PreconditionFailed, NotFound):
            continue  # another worker won this one: try the next
        return Lease(run, path, worker, ttl, new_etag, new)
    raise NothingToClaim(f"nothing to claim in {run.url}: every path is done, failed or held by a live lease")


def release(run: Run, path: str, state: str = "open", by: str | None = None) -> dict[str, Any]:
    """Admin override: set a path's record to open (claimable again) or failed, recording who."""
    if state not in ("open", "failed"):
        raise ConfigurationError(f"--state must be open or failed, got {state!r}")
    for _ in range(10):
        record, etag = read_claim(run, path)
        now = time.time()
        new = {**(record or {"path": path, "generation": 0}), "state": state, "released_by": by or _who(), "released_at": now}
        try:
            if record is None:
                run.store.put_if_absent(run.claim(path), _dump(new))
            else:
                run.store.put_if_match(run.claim(path), _dump(new), etag)
            return new
        except PreconditionFailed:
            continue  # the holder renewed meanwhile: read again
    raise PreconditionFailed(f"{run.store.url_of(run.claim(path))} kept changing: try again")


def _who() -> str:
    return f"{os.environ.get('USER', 'unknown')}@{socket.gethostname()}"


# -- the local record of a claim, so `paths train` finds it ---------------------------------------
def claim_file() -> str:
    """$PATHS_HOME/claim.json, else ./.paths/claim.json."""
    home = os.environ.get("PATHS_HOME")
    return os.path.join(home, "claim.json") if home else os.path.join(".paths", "claim.json")


def save_local(lease: Lease) -> str:
    path = claim_file()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(lease.to_json(), f, indent=2)
    os.replace(tmp, path)
    return path


def load_local() -> dict[str, Any] | None:
    try:
        with open(claim_file()) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def resume_lease(run: Run, path: str | None) -> Lease:
    """The lease `paths claim` recorded locally, checked against the store."""
    local = load_local()
    if local is None or local.get("run") != run.url:
        raise ConfigurationError(f"no claim on {run.url} recorded in {claim_file()}: run `paths claim {run.url}` first")
    if path is not None and path != local["path"]:
        raise ConfigurationError(f"this worker's claim is on {local['path']}, not {path}: claim {path} with `paths claim {run.url} --path {path}`")
    record, etag = read_claim(run, local["path"])
    if record is None or record.get("worker") != local["worker"] or int(record.get("generation", -1)) != local["generation"] or record.get("state") != "claimed":
        holder = "nobody" if record is None else f"{record.get('worker')} (generation {record.get('generation')}, {record.get('state')})"
        raise LeaseLost(f"the claim on {local['path']} recorded in {claim_file()} is not ours any more: it is held by {holder}; run `paths claim` again")
    return Lease(run, local["path"], local["worker"], float(local["ttl"]), etag, record)


def claimed_run() -> str:
    """The run of the claim recorded locally (when `paths train` is given no RUN)."""
    local = load_local()
    if local is None:
        raise ConfigurationError(f"no RUN given and no claim recorded in {claim_file()}: give RUN (or set PATHS_RUN) after `paths claim RUN`")
    return local["run"]


def lease_for_rank(run: Run, path: str | None) -> tuple[Lease | None, str]:
    """(lease, path) for this process: rank 0 (of `accelerate launch` / torchrun, from $RANK)
    holds and renews the lease; other ranks train the same path and hold nothing."""
    if int(os.environ.get("RANK", "0")) == 0:
        lease = resume_lease(run, path)
        return lease, lease.path
    path = path or (load_local() or {}).get("path")
    if path is None:
        raise ConfigurationError("give --path on every rank, or run `paths claim` where all ranks can read its claim.json")
    return None, path
