"""The asynchronous trainer's data: rollout batches from the store, read within budgets, taken in
each worker's chain order, checked.

Who is heard: in a closed run (the default) only folders of admitted, unrevoked workers are read,
and a batch there counts only with that worker's signature; `paths keys open` also lets unsigned
batches in, each folder name then being its own identity. Strikes count per identity (a key), and
an identity struck `max_rejections` times is read no more. Only what the signer provably did
strikes it (signed content that fails a check, two batches for one place of its chain, a version
this run never published), and a rejected batch is no way past its place in the chain; what nobody provably sent (a torn object, a bad signature, a copy of a
signed batch) is recorded and costs only its folder's read budget: at most `rollout_reads` objects
per folder per step are read, and at most twice that held in memory.

Each worker's batches form a chain: the batch at position p names (signed) the digest of the one
at p - 1, and its seeds depend on p. The trainer takes a chain in order, one position at a time,
so a worker can neither sample many positions and keep the best nor skip one by writing something
else: to pass over a batch it must let it go stale, which holds its whole chain back.

The position (consumed, discarded and rejected keys, strikes, every chain, the hashes of the rows
taken, the salt of the nonces, the versions published) is saved in every checkpoint: after a kill
and a takeover no batch is used twice or lost, and the same versions get the same nonces.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from paths.errors import ConfigurationError, NotFound
from paths.work.rewards import Reward
from paths.work.mixture import Mixture
from paths.work.rollouts.batch import Batch, Rejected, batch_bytes_limit, decode, parse_key
from paths.work.rollouts.keys import Allowlist, read_allowlist
from paths.work.rollouts.policy import version_record
from paths.work.rollouts.poll import Poll
from paths.work.rollouts.seeds import run_id
from paths.work.rollouts.verify import BatchVerifier, Verified
from storage.layout import Run

POLL = 0.2  # seconds between listings while waiting, at most
RECENT = 64  # digests a chain remembers, to tell a copy of a batch from a second batch for one place
log = logging.getLogger("paths.rollouts")


@dataclass
class Chain:
    """Where one worker's chain stands at the trainer."""

    next: int = 0  # the position taken next
    head: str = ""  # digest of the batch at next - 1
    version: int = -1  # its policy version
    recent: list[str] = field(default_factory=list)  # digests of the last RECENT positions


@dataclass
class StoreRollouts:
    """Rollout batches of one path for its asynchronous trainer: the Batches protocol (position
    saved in checkpoints) plus take(), which hands out verified batches."""

    run: Run
    path: str
    dataset: str
    cfg: Any
    records: list[dict[str, Any]]
    rewards: list[Reward]
    tokenizer: Any
    make_model: Callable[[], torch.nn.Module]  # a fresh fp32 model of the path (to recompute what workers sampled)
    device: Any = "cpu"  # where the checks run (int8 ones on the CPU)
    episodes: Any = None  # a multi-turn environment's EpisodeSampler: batches of episodes, replayed to be checked
    steps: int = 0
    consumed: list[str] = field(default_factory=list)
    discarded: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    strikes: dict[str, int] = field(default_factory=dict)  # identity ("key:<hex>" or, in an open run, "name:<folder>") -> lies
    chains: dict[str, Chain] = field(default_factory=dict)  # identity -> its chain
    external: dict[str, int] = field(default_factory=dict)  # SAPO: other paths' batches -> groups of them taken
    rows: dict[int, list[str]] = field(default_factory=dict)  # policy version -> hashes of the rows taken from it
    salt: str = field(default_factory=lambda: secrets.token_hex(32))  # the nonces' secret
    known: set[tuple[int, str, str]] = field(default_factory=set)  # (version, sha256, nonce) of every version published in this run's lineage
    started_at: int = 0  # the step this trainer process started from: versions above it were published before a restart
    on_starving: Callable[[], None] | None = None
    allow: Allowlist = field(default_factory=Allowlist)
    other_records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # SAPO: other paths' prompts, by dataset/path
    _seen_rows: set[str] = field(default_factory=set)
    _held: dict[str, tuple[Batch, str]] = field(default_factory=dict)  # read and well signed, not resolved yet: never read twice

    def __post_init__(self) -> None:
        self.mixture = Mixture(self.records, self.cfg.mixture, f"dataset {self.dataset!r} for path {self.path}") if self.cfg.mixture else None
        self.verifier = BatchVerifier(self.run, self.path, self.dataset, run_id(self.run), self.cfg, self.records, self.rewards, self.tokenizer, self.make_model, self.device,
                                      self.episodes, self.mixture)
        self.allow = read_allowlist(self.run)  # a malformed allowlist stops the trainer before it starts
        if not self.allow.open and not any(w.active for w in self.allow.workers.values()):
            log.warning("no rollout worker is admitted to %s: admit one with `paths keys admit RUN --name NAME --key PUBLIC` (or `paths keys open RUN`); "
                        "until then this trainer samples its steps itself", self.run.url)

    # the Batches protocol: the trainer saves and restores the position
    def __iter__(self) -> "StoreRollouts":
        return self

    def __next__(self) -> dict[str, Any]:
        raise TypeError("StoreRollouts hands out verified batches through take(), not next()")

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "consumed": list(self.consumed), "discarded": list(self.discarded), "rejected": dict(self.rejected), "strikes": dict(self.strikes),
                "chains": {k: asdict(c) for k, c in self.chains.items()}, "external": dict(self.external), "rows": {str(v): list(h) for v, h in self.rows.items()},
                "salt": self.salt, "known": sorted(list(k) for k in self.known)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.consumed, self.discarded = int(state["steps"]), list(state["consumed"]), list(state["discarded"])
        self.rejected, self.strikes = dict(state["rejected"]), {k: int(v) for k, v in state["strikes"].items()}
        self.chains = {k: Chain(**c) for k, c in state.get("chains", {}).items()}
        self.external = {k: int(v) for k, v in state.get("external", {}).items()}
        self.rows = {int(v): list(h) for v, h in state.get("rows", {}).items()}
        self._seen_rows = {h for hs in self.rows.values() for h in hs}
        self.salt = state.get("salt", self.salt)
        self.known = {(int(v), str(s), str(n)) for v, s, n in state.get("known", [])}

    def published(self, record: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
        """A policy version record this trainer (or one before it) published; with the `tensors`
        it stands for (as this trainer just published it: full or rebuilt from a delta), the checks
        keep a copy and load that version from memory."""
        self.known.add((int(record["version"]), str(record["sha256"]), str(record.get("nonce", ""))))
        if tensors is not None:
            self.verifier.remember(record, tensors)

    @property
    def ignored(self) -> set[str]:
        return {w for w, n in self.strikes.items() if n >= self.cfg.max_rejections}

    def describe(self) -> str:
        return self.verifier.describe()

    # -- who wrote a folder ------------------------------------------------------------------------
    def identity(self, folder: str) -> tuple[str, str | None] | None:
        """(identity, the key that must have signed) of a worker folder; None when nobody admitted
        may write there (closed run); ("revoked", key) for a revoked worker."""
        worker = self.allow.workers.get(folder)
        if worker is not None:
            return ("revoked" if not worker.active else f"key:{worker.key}", worker.key)
        return (f"name:{folder}", None) if self.allow.open else None

    def _refresh_allowlist(self) -> None:
        try:
            self.allow = read_allowlist(self.run)
        except ConfigurationError as exc:  # edited into nonsense mid-run: hear nobody until it is mended
            log.warning("%s: reading no rollout batches until it is mended", exc)
            self.allow = Allowlist()

    # -- taking batches ----------------------------------------------------------------------------
    def take(self, count: int, wait: float) -> tuple[list[Verified], dict[str, float]]:
        """Up to `count` verified batches usable at this step (policy version within max_async of
        it), waiting up to `wait` seconds for them; stale ones are discarded and bad ones rejected
        on the way, each folder read at most `rollout_reads` times."""
        cfg, step = self.cfg, self.steps
        taken: list[Verified] = []
        stats = {"stale_batches": 0.0, "rejected_batches": 0.0, "verify_seconds": 0.0, "verified_rows": 0.0}
        budget = cfg.rollout_reads or (cfg.max_async + 1) * cfg.grad_accum + cfg.max_rejections
        reads: dict[str, int] = {}
        deadline, starving, poll = time.time() + wait, False, Poll(POLL)  # a worker's batch is usually a moment away
        self._refresh_allowlist()
        records: dict[int, dict[str, Any] | None] = {}

        def record_of(v: int) -> dict[str, Any] | None:
            if v not in records:
                records[v] = version_record(self.run, self.path, v)
            return records[v]

        while len(taken) < count:
            seen = self._resolved()
            listing = {o.key: o.size for o in self.run.store.list(f"{self.run.rollouts(self.path)}/batches")}
            self._held = {k: v for k, v in self._held.items() if k in listing}
            progressed = self._read_new(listing, seen, budget, reads, stats)
            candidates, ready = [], set()
            for key, (batch, who) in sorted(self._held.items(), key=lambda kv: (kv[1][1], kv[1][0].position, parse_key(kv[0]))):  # the first written of two copies wins
                if who in ready:
                    continue  # one batch per chain at a time: the next is placed once this one is taken
                state = self._place(batch, who, step, record_of(batch.version), stats)
                progressed |= state != "wait"
                if state == "ok":
                    candidates.append(batch)
                    ready.add(who)
            for batch in sorted(candidates, key=lambda b: (b.version, b.key)):
                if len(taken) == count:
                    break
                verified = self._verify(batch, record_of(batch.version), stats)
                taken += [verified] if verified is not None else []
                progressed = True
            if progressed:
                poll.reset()
            if len(taken) < count and not progressed:
                if not starving and self.on_starving is not None:
                    self.on_starving()  # tell the workers nothing usable waits, or they hold back
                starving = True
                if time.time() >= deadline:
                    break
                poll.sleep()
        self._forget(step - cfg.max_async)
        return taken, stats

    def waiting(self) -> tuple[int, dict[str, int]]:
        """Batches the coming steps can take, counted as the policy is published (told to the
        workers, who hold back while enough wait): those held in their chain's order, sampled
        recently enough, plus the objects of heard folders not read yet. Counted at take time, or
        only each chain's next batch, it missed what a fast worker wrote meanwhile, and the queue
        grew until batches went stale. With it, the highest object number listed in each folder:
        a worker's batches above it (written while this was counted) are not in the count."""
        seen, ignored, unread, heard = self._resolved() | self._held.keys(), self.ignored, 0, {}
        for o in self.run.store.list(f"{self.run.rollouts(self.path)}/batches"):
            where = parse_key(o.key)
            who = self.identity(where[0]) if where else None
            if who is None or who[0] == "revoked" or who[0] in ignored:
                continue  # nobody this trainer hears (a folder anyone may make: not named back either)
            heard[where[0]] = max(heard.get(where[0], -1), where[1])
            unread += o.key not in seen
        return self._queued(self.steps - self.cfg.max_async) + unread, heard

    def _resolved(self) -> set[str]:
        """Keys of the batches taken, discarded or rejected: never read again."""
        return set(self.consumed) | set(self.discarded) | set(self.rejected)

    def _queued(self, oldest: int) -> int:
        """Held batches waiting in order in their chains (from each chain's next position on, no
        gap), sampled from version `oldest` or later."""
        held: dict[str, dict[int, int]] = {}
        for batch, who in self._held.values():
            held.setdefault(who, {})[batch.position] = batch.version
        queued = 0
        for who, versions in held.items():
            position = self.chains[who].next if who in self.chains else 0
            while position in versions and versions[position] >= oldest:
                queued, position = queued + 1, position + 1
        return queued

    def _read_new(self, listing: dict[str, int], seen: set[str], budget: int, reads: dict[str, int], stats: dict[str, float]) -> bool:
        """Read the objects nobody looked at yet in heard folders, within each folder's budget and
        hold; whether anything was read."""
        progressed = False
        fresh = sorted((where, key) for key in listing.keys() - seen - self._held.keys() if (where := parse_key(key)))
        for (folder, _), key in fresh:
            who = self.identity(folder)
            if who is None or who[0] in self.ignored:
                continue  # a folder nobody admitted writes to, or a liar's: never read
            if reads.get(folder, 0) >= budget or sum(1 for b, _ in self._held.values() if b.worker == folder) >= 2 * budget:
                continue  # this folder's reads for this step are spent, or it has enough waiting
            reads[folder] = reads.get(folder, 0) + 1
            progressed = True
            batch = self._read(key, folder, who, listing[key], stats)
            if batch is not None:
                self._held[key] = (batch, who[0])
        return progressed

    def _read(self, key: str, folder: str, who: tuple[str, str | None], size: int, stats: dict[str, float]) -> Batch | None:
        """The batch at `key` decoded, its signature checked, meant for this run, path and dataset;
        None when rejected (recorded) or gone."""
        limit = batch_bytes_limit(self.cfg, self.episodes is not None)
        try:
            if who[0] == "revoked":
                raise Rejected("written under a revoked worker key: not read", attributable=False)
            if size > limit:
                raise Rejected(f"{size:,} bytes, more than the {limit:,} a batch of this trainer's settings can take (oversized): not read", attributable=False)
            batch = decode(self.run.store.read(key), key, limit, who[1])
            meta = batch.meta
            if batch.worker != folder or (meta["run"], meta["path"], meta["dataset"]) != (self.verifier.run_id, self.path, self.dataset):
                raise Rejected(f"signed for worker {batch.worker!r}, run {meta['run']}, path {meta['path']}, dataset {meta['dataset']}, but lies in {folder} of this "
                               f"trainer's ({self.verifier.run_id}, {self.path}, {self.dataset}): copied here", attributable=False)
            return batch
        except NotFound:
            return None  # removed between the listing and the read
        except Rejected as exc:
            self._reject(key, folder, who[0] if exc.attributable and who[0] != "revoked" else None, str(exc), stats)
        except Exception as exc:  # whatever else hostile bytes provoke: refused, never a crash of the trainer
            self._reject(key, folder, None, f"unreadable ({type(exc).__name__}: {str(exc)[:80]})", stats)
        return None

    def _place(self, batch: Batch, who: str, step: int, record: dict[str, Any] | None, stats: dict[str, float]) -> str:
        """Where a held batch stands in its worker's chain: "ok" (next, usable now), "wait" (a later
        position, or a version this trainer will publish again), or resolved here: "stale"
        (discarded) or "rejected"."""
        current = self.identity(batch.worker)
        if current is None or current[0] != who or who in self.ignored:
            self._held.pop(batch.key)
            if current is not None and current[0] == "revoked":
                self._reject(batch.key, batch.worker, None, "its worker key was revoked: not taken", stats)
            return "rejected"
        chain = self.chains.setdefault(who, Chain())
        try:
            if batch.digest == chain.head or batch.digest in chain.recent:
                raise Rejected(f"a copy of the batch at position {batch.position} of {batch.worker}'s chain (replay)", attributable=False)
            if batch.position < chain.next:
                raise Rejected(f"a second, different batch for position {batch.position} of {batch.worker}'s chain (it is at {chain.next})")
            if batch.position > chain.next:
                return "wait"  # its predecessors come first
            if batch.meta["previous"] != chain.head:
                raise Rejected(f"position {batch.position} does not follow the batch {batch.worker} wrote before it (previous {batch.meta['previous'][:12]}, "
                               f"the chain's {chain.head[:12]})")
            if batch.version < chain.version and chain.version <= self.started_at:
                raise Rejected(f"policy version {batch.version} after {chain.version} in {batch.worker}'s chain: workers load versions in order")
            state = self._version_state(batch, step, record)
        except Rejected as exc:
            self._held.pop(batch.key)
            self._reject(batch.key, batch.worker, who if exc.attributable else None, str(exc), stats)
            return "rejected"  # the chain stays: a rejected batch is no way past its position
        if state == "stale":
            self._held.pop(batch.key)
            self.discarded.append(batch.key)
            stats["stale_batches"] += 1
            self._advance(who, batch)
        return state

    def _version_state(self, batch: Batch, step: int, record: dict[str, Any] | None) -> str:
        """"ok", "wait" (a version this trainer will publish again), "stale", or Rejected."""
        said = (batch.version, batch.meta["policy_sha256"], batch.meta["nonce"])
        if batch.version > step:
            if said in self.known:
                return "wait"
            raise Rejected(f"policy version {batch.version} with that checksum and nonce was never published (the trainer is at {step})")
        if step - batch.version > self.cfg.max_async:
            return "stale"
        if record is not None and said == (int(record["version"]), str(record["sha256"]), str(record.get("nonce", ""))):
            return "ok"
        if said in self.known:
            return "stale"  # sampled from a version a restarted trainer has published anew
        raise Rejected(f"sampled from policy version {batch.version} with a checksum or nonce this run never published (stale-by-checksum spam, or made up)")

    def _verify(self, batch: Batch, record: dict[str, Any] | None, stats: dict[str, float]) -> Verified | None:
        """Every check of verify.py; the batch consumed, its rows remembered and its chain moved on,
        or None (rejected, or discarded when the version went away meanwhile)."""
        _, who = self._held.pop(batch.key)
        t0 = time.perf_counter()
        try:
            verified = self.verifier.verify(batch, record, self._seen_rows.__contains__)
        except Rejected as exc:
            if exc.attributable:
                self._reject(batch.key, batch.worker, who, str(exc), stats)  # the chain stays: a rejected batch is no way past its position
            else:  # the trainer's side (a version pruned meanwhile, non-finite logits): not the worker's doing
                self.discarded.append(batch.key)
                stats["stale_batches"] += 1
                self._advance(who, batch)
            return None
        finally:
            stats["verify_seconds"] += time.perf_counter() - t0
        self.consumed.append(batch.key)
        self.rows.setdefault(verified.version, []).extend(verified.rows)
        self._seen_rows.update(verified.rows)
        stats["verified_rows"] += verified.check.rows
        self._advance(who, batch)
        return verified

    def _advance(self, who: str, batch: Batch) -> None:
        """The chain moves past `batch` (taken, or gone stale)."""
        chain = self.chains.setdefault(who, Chain())
        chain.next, chain.head, chain.version = batch.position + 1, batch.digest, batch.version
        chain.recent = [*chain.recent, batch.digest][-RECENT:]

    def _forget(self, oldest: int) -> None:
        """Row hashes and version records no batch may use any more (older than max_async)."""
        for v in [v for v in self.rows if v < oldest]:
            self._seen_rows.difference_update(self.rows.pop(v))
        self.known = {k for k in self.known if k[0] >= oldest}

    def _reject(self, key: str, folder: str, identity: str | None, reason: str, stats: dict[str, float]) -> None:
        """Record a rejection; a strike for `identity` when the lie is provably its own."""
        self.rejected[key] = reason
        stats["rejected_batches"] += 1
        if identity is not None:
            self.strikes[identity] = self.strikes.get(identity, 0) + 1
        record = {"key": key, "worker": folder, "identity": identity, "attributed": identity is not None, "reason": reason, "trainer_step": self.steps, "at": time.time(),
                  "ignored": identity is not None and self.strikes[identity] >= self.cfg.max_rejections}
        if not self.run.store.read_only:
            self.run.store.write(f"{self.run.rollouts(self.path)}/rejected/{folder}/{key.rsplit('/', 1)[1].split('.')[0]}.json", json.dumps(record, sort_keys=True).encode())
