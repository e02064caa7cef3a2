"""Claims: workers coordinate through the store alone, with conditional writes (DESIGN.md, Claims).

A path's record `claims/<path>.json` moves through states:

    (absent) --claim: If-None-Match *--> claimed --done--> done
                                   |  ^                --fail--> failed
               renew: If-Match --- +  | takeover of an expired lease: If-Match, generation + 1
    claimed --release (admin) / handoff on SIGTERM--> open --claim: If-Match--> claimed
    claimed --a DiLoCo round ends, others not in--> waiting (round r) --claim once composed/round-<r>/ exists--> claimed

Every change is a compare-and-swap on the record's etag, so of two writers exactly one wins; a
holder whose renewal is refused (412) has lost the lease and must stop writing (fencing).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from paths.errors import ConfigurationError, DataError, LeaseLost, NothingToClaim, NotFound, PathsError, PreconditionFailed, StillWaiting
from storage.layout import Run

STATES = ("claimed", "done", "failed", "open", "waiting")
MIN_TTL = 5.0  # seconds: `paths train` takes about 1 s from start to its first renewal, then renews every ttl/3
PROBES = 2  # create-only guesses before claims/ is listed
LIST_PAGE = 32  # keys in the first page of that listing (a page of 32 costs about one put; 1,000 about five)
HISTORY = 32  # tenures kept in a claim record's history
GRACE = (0.1, 0.25)  # a takeover waits this share of the holder's ttl past expiry (jittered, at most 30 s)


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
    """(record, etag) of a path's claim, or (None, None) when nobody ever claimed it; a record that
    is not a claim (edited by hand, half a file) is refused naming the fix."""
    try:
        data, etag = run.store.read_with_etag(run.claim(path))
    except NotFound:
        return None, None
    try:
        record = json.loads(data)
        ok = isinstance(record, dict) and record.get("state") in STATES and int(record.get("generation", 0)) >= 0 and float(record.get("expires_at", 0)) >= 0
    except (ValueError, TypeError):
        ok = False
    if not ok:
        raise DataError(f"{run.store.url_of(run.claim(path))} is not a claim record (state, generation, expires_at): "
                        f"reset it with `paths storage release {run.url} --path {path}`")
    return record, etag


def check_ttl(ttl: float, latency: float = 0.0) -> None:
    """Refuse a lease too short to keep: the heartbeat renews every ttl/3 and `paths train` needs
    about a second to start; `latency` is one measured round trip to the store."""
    workable = max(MIN_TTL, 10 * latency)
    if ttl < workable:
        raise ConfigurationError(f"--ttl {ttl:g} is too short to keep renewed (the heartbeat renews every ttl/3, a worker needs about 1 s to start"
                                 f"{f', a round trip to the store takes {latency:.2f} s' if latency else ''}): use --ttl {math.ceil(workable * 2)} or more")


def takeover_at(record: dict[str, Any], rng: random.Random) -> float:
    """When an expired lease may be taken over: its expiry plus a jittered grace (a share of its
    ttl, at most 30 s), so a holder whose renewal is merely late is not taken from at once."""
    return float(record.get("expires_at", 0)) + min(30.0, rng.uniform(*GRACE) * float(record.get("ttl", 0) or 0))


def claimable(record: dict[str, Any] | None, now: float, ready: Callable[[int], bool] | None = None) -> bool:
    """Nobody claimed it, it was released, its holder's lease expired, or (DiLoCo) the round it
    waits for has its outer step (`ready(round)`)."""
    if record is None:
        return True
    state = record.get("state")
    if state == "waiting":
        return ready is not None and ready(int(record.get("round", 0)))
    return state == "open" or (state == "claimed" and float(record.get("expires_at", 0)) < now)


def claim(run: Run, paths: list[str], *, ttl: float = 600, worker: str | None = None, rng: random.Random | None = None, wait: float = 0.0) -> Lease:
    """Claim one of `paths`: the first claimable one in a random order (so racing workers rarely
    collide), by create-only put or by takeover of an expired / released record. Round trips: the
    first PROBES tries are a create-only put alone each; then claims/ listed a page at a time from
    a random point (`_scan`), a create-only put where a page shows no record, and, once no page has
    a free path left, a read and a conditional put per path with a record. A refused
    create-only put is not read back at once: the path goes to the end of the order, and if its
    record, read then, is the one the put tried to create, the HTTP client resent our put by itself
    and the claim is ours; a record of ours never read again expires with its ttl and is taken
    over, nobody writing to it meanwhile. (Near the end of a run, where racers find the same few
    free paths, a read back at once would add a round trip to every lost race.)
    `wait`: seconds to keep trying while paths wait for a DiLoCo round's outer step."""
    if ttl <= 0:
        raise ConfigurationError(f"--ttl must be > 0 seconds, got {ttl}")
    worker = worker or default_worker()
    rng = rng or random.Random()
    deadline = time.time() + wait
    while True:
        try:
            return _claim(run, paths, ttl, worker, rng)
        except NothingToClaim as nothing:
            if not nothing.waiting or time.time() >= deadline:
                raise
        time.sleep(min(5.0, max(0.0, deadline - time.time())))


def _claim(run: Run, paths: list[str], ttl: float, worker: str, rng: random.Random) -> Lease:
    outer: dict[int, bool] = {}

    def ready(r: int) -> bool:  # a DiLoCo round's outer step is there, or nobody is computing it (looked up once per claim)
        if r not in outer:
            outer[r] = r >= 1 and (outer_done(run, r) or round_stalled(run, r))
        return outer[r]

    waiting = 0
    guessed: dict[str, bytes] = {}  # path -> the record a refused create-only put tried to create
    held: list[str] = []  # paths with a record, read in turn once no free one is left

    def take(path: str, record: dict[str, Any] | None, etag: str | None) -> Lease | None:
        nonlocal waiting
        if path in guessed and record is not None and _dump(record) == guessed[path]:  # our refused put was ours after all (resent)
            return Lease(run, path, worker, ttl, etag, record)
        now = time.time()
        if not claimable(record, now, ready) or (record is not None and record.get("state") == "claimed" and now < takeover_at(record, rng)):
            waiting += record is not None and record.get("state") == "waiting"
            return None
        new = {
            "path": path, "state": "claimed", "worker": worker, "ttl": ttl,
            "generation": 1 if record is None else int(record.get("generation", 0)) + 1,
            "claimed_at": now, "renewed_at": now, "expires_at": now + ttl,
        }
        if record is not None:
            new["previous"] = {k: record.get(k) for k in ("worker", "state", "generation", "expires_at")}
            new["history"] = history(record, now)
            for k in ("step", "tokens", "loss", "committed_step"):
                if k in record:
                    new[k] = record[k]
        try:
            if record is None:  # a path's first create-only put is not read back when refused (see the docstring)
                new_etag = run.store.put_if_absent(run.claim(path), _dump(new), confirm=path in guessed)
            else:
                new_etag = run.store.put_if_match(run.claim(path), _dump(new), etag)
        except (PreconditionFailed, NotFound):
            if record is None and path not in guessed:
                guessed[path] = _dump(new)
                held.append(path)  # it has a record after all: read it in its turn (it may be expired or open, or this very put)
            return None  # another worker won this one: try the next
        return Lease(run, path, worker, ttl, new_etag, new)

    order = rng.sample(paths, len(paths))  # each worker its own order: no clusters of held paths to walk past
    for path in order[:PROBES]:  # guesses that nobody claimed it: one create-only put each
        if lease := take(path, None, None):
            return lease
    if len(paths) > PROBES:  # a few held ones in a row: list claims/ for those nobody claimed yet
        for free, recorded in _scan(run, paths, rng):
            for path in free:
                if path not in guessed and (lease := take(path, None, None)):
                    return lease
            held.extend(p for p in recorded if p not in guessed)
    i = 0
    while i < len(held):  # grows while read: a put refused here goes to the end
        path, i = held[i], i + 1
        if lease := take(path, *read_claim(run, path)):
            return lease
    if waiting:
        raise StillWaiting(f"nothing to claim in {run.url} now: {waiting} paths wait for a DiLoCo round's outer step, which the worker of the round's last path computes; "
                           "claim again in a while (`paths claim --wait SECONDS`)", waiting=waiting)
    raise NothingToClaim(f"nothing to claim in {run.url}: every path is done, failed or held by a live lease")


def _scan(run: Run, paths: list[str], rng: random.Random) -> Iterator[tuple[list[str], list[str]]]:
    """claims/ listed a page at a time from a random one of `paths` on, round to the start and up
    to it: (free, recorded) of `paths` in each page: the free path nearest the start first (racers
    start apart, so they go for different paths as if each drew one of all the free ones), the
    others and the recorded ones in a random order. Racers stop at the first page with a free path,
    so one small page is the usual cost even where 1,000s of paths have records; pages grow
    (LIST_PAGE keys, then twice as many each time) where few are free."""
    by_key = sorted((run.claim(p), p) for p in paths)
    keys = [k for k, _ in by_key]
    first, size = rng.randrange(len(keys)), LIST_PAGE
    for lo, hi in ((first, len(keys)), (0, first)):
        after = keys[lo - 1] if lo else ""
        while lo < hi:
            listed, after = run.store.list_page("claims", after, size)
            end = hi if after is None else min(hi, bisect.bisect_right(keys, after))
            there = set(listed)
            free, recorded = [p for k, p in by_key[lo:end] if k not in there], [p for k, p in by_key[lo:end] if k in there]
            yield free[:1] + rng.sample(free[1:], len(free[1:])), rng.sample(recorded, len(recorded))
            lo, size = end, min(1000, 2 * size)


def outer_done(run: Run, r: int) -> bool:
    """DiLoCo round r's outer step is committed (composed/round-<r>/manifest.json)."""
    return run.store.exists(f"{run.composed(f'round-{r}')}/manifest.json")


def round_published(run: Run, r: int) -> set[str]:
    """Paths whose weights at the end of DiLoCo round r are committed (diloco/r<r>/<path>/manifest.json), one listing."""
    prefix = run.diloco(r) + "/"
    return {o.key[len(prefix):].split("/")[0] for o in run.store.list(run.diloco(r)) if o.key.endswith("/manifest.json") and o.key.count("/") == 3}


def round_owed(run: Run, r: int, paths: list[str] | tuple[str, ...]) -> tuple[set[str], dict[str, dict[str, Any] | None]]:
    """(published, owed) of DiLoCo round r among `paths`: those whose weights for the round are
    in, and those still to come with their claim records (None: never claimed). A path an admin
    marked failed (`paths storage release --state failed`) owes nothing: it is dropped from the
    rounds, as DiLoCo goes on without a worker that left; one listing and a read per path not in."""
    ins = round_published(run, r) & set(paths)
    owed: dict[str, dict[str, Any] | None] = {}
    for p in sorted(set(paths) - ins):
        record, _ = read_claim(run, p)
        if record is None or record.get("state") != "failed":
            owed[p] = record
    return ins, owed


def round_stalled(run: Run, r: int) -> bool:
    """Every path of DiLoCo round r is in (or failed), yet nobody holds a live lock on its outer
    step (its worker died computing it): a path waiting for it is claimable, and whoever claims it
    computes it."""
    spec = run.read_meta().get("diloco") or {}
    if not spec:
        return False
    ins, owed = round_owed(run, r, spec.get("paths", []))
    if owed or not ins:
        return False
    try:
        lock = json.loads(run.store.read(f"{run.diloco(r)}/outer.json"))
    except NotFound:
        return True
    except ValueError:
        return True
    return lock.get("state") != "computing" or float(lock.get("expires_at", 0)) < time.time()


def history(record: dict[str, Any], now: float) -> list[dict[str, Any]]:
    """The record's tenures (who held the path, from when to when, how it ended), with the one
    that `record` holds closed, the newest HISTORY of them: the claims timeline of `paths report`."""
    past = [t for t in record.get("history", []) if isinstance(t, dict)]
    if record.get("worker") and record.get("claimed_at") is not None:
        state = record.get("state")
        ended = {"claimed": "expired", "open": "released" if record.get("released_at") else "handed back", "waiting": f"round {record.get('round')} done"}.get(state, state)
        until = record.get("released_at") or record.get("finished_at") or min(float(record.get("expires_at", now)), now)
        past.append({"worker": record["worker"], "generation": record.get("generation"), "from": record["claimed_at"], "until": until, "ended": ended, "step": record.get("step")})
    return past[-HISTORY:]


class Heartbeat(threading.Thread):
    """Renews a lease every `interval` seconds (ttl/3, at most 30) with the latest progress, from
    the moment `keep_alive` starts it; a refused renewal is kept in `lost` and told to `on_lost`.
    `lock` serialises renewals with the holder's own writes to the record (finish, hand-off)."""

    def __init__(self, lease: Lease, interval: float | None = None):
        super().__init__(daemon=True, name="paths-heartbeat")
        self.lease = lease
        self.interval = interval or max(0.2, min(lease.ttl / 3, 30.0))
        self.progress: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.lost: LeaseLost | None = None
        self.on_lost: Callable[[LeaseLost], None] | None = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            try:
                self.renew()
            except LeaseLost:
                return  # kept in self.lost: the holder stops before it writes anything more

    def renew(self) -> None:
        """Renew now (also the fencing check before a commit); raises LeaseLost."""
        with self.lock:
            try:
                self.lease.renew(**self.progress)
            except LeaseLost as exc:
                self.lost = exc
                if self.on_lost is not None:
                    self.on_lost(exc)
                raise
            except PathsError:
                pass  # a transient storage error: the next beat retries well before expiry

    def stop(self) -> None:
        self.done.set()


def keep_alive(lease: Lease) -> Heartbeat:
    """Renew the lease now (LeaseLost if it is not ours) and keep renewing it from a thread."""
    beat = Heartbeat(lease)
    beat.renew()
    beat.start()
    return beat


def release(run: Run, path: str, state: str = "open", by: str | None = None) -> dict[str, Any]:
    """Admin override: set a path's record to open (claimable again) or failed, recording who; a
    record that is not a claim any more (edited by hand) is replaced."""
    if state not in ("open", "failed"):
        raise ConfigurationError(f"--state must be open or failed, got {state!r}")
    for _ in range(10):
        try:
            record, etag = read_claim(run, path)
        except DataError:  # nonsense in the record: replace it whole
            _, etag = run.store.read_with_etag(run.claim(path))
            record = {"path": path, "generation": 0, "replaced": "a record that was not a claim"}
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
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(lease.to_json(), f, indent=2)
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigurationError(f"cannot write the claim to {path} ({exc.strerror}): set PATHS_HOME to a writable folder") from None
    return path


def check_home() -> str:
    """The folder the claim file goes to, writable (checked before anything is claimed)."""
    folder = os.path.dirname(os.path.abspath(claim_file()))
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".probe-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise ConfigurationError(f"cannot write the claim to {folder} ({exc.strerror}): set PATHS_HOME to a writable folder") from None
    return folder


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
