"""Policy versions: what the asynchronous trainer publishes after each step, and workers sample from.

    policy/<path>/v<N>/model.safetensors   a full version: every tensor, fp32
    policy/<path>/v<N>/delta.safetensors.zst   a delta against v<N-1> (a full fine-tune; versions.py)
    policy/<path>/v<N>/adapter.safetensors  a LoRA unit's adapter, over its base:
    policy/<path>/base-<sha>/model.safetensors   the frozen base of an adapter unit, written once
    policy/<path>/v<N>/policy.json         its kind, file checksum, the sha256 of the weights it
                                           stands for and the version's nonce; written last, so a
                                           version exists once its policy.json does
    policy/<path>/latest.json              the newest version's record (+ how many batches wait, and
                                           the newest object listed in each worker's folder)

The nonce is the trainer's: HMAC of its secret salt over the path, version and weights' sha256
(seeds.nonce). Every sample of the version is drawn with numbers derived from it. A delta's chain
starts at a full version (`snapshot`) at most `policy_snapshot_every` versions back, so a worker
that lacks the version before a delta rebuilds it from there, never from the start.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from typing import Any, Callable

import torch

from paths.adapters import LoraSpec, adapter_state, merge
from paths.errors import ConfigurationError, DataError, NotFound
from paths.trainer import Callback
from paths.work.quantize import int8_copy
from paths.work.rollouts.batch import DTYPES, FORMAT
from paths.work.rollouts.seeds import nonce
from paths.work.rollouts.versions import apply_delta, assign, encode_delta, read_tensors, state_digest, weights, write_tensors
from storage.layout import Run

FILES = {"full": "model.safetensors", "delta": "delta.safetensors.zst", "adapter": "adapter.safetensors"}


def adapter_digest(base_sha256: str, file_sha256: str, scale: float) -> str:
    """An adapter version's sha256: its base's weights, its adapter file and its scale, together (what
    the version's nonce covers, so none of the three can be swapped under it)."""
    return hashlib.sha256(f"{base_sha256}:{file_sha256}:{float(scale)!r}".encode()).hexdigest()


def version_key(run: Run, path: str, version: int) -> str:
    return f"{run.policy(path)}/v{version:08d}"


def _record(run: Run, path: str, version: int, salt: str, kind: str, digest: str, file: dict[str, Any], **meta: Any) -> dict[str, Any]:
    """Write policy.json (the version exists from now on) and point latest.json at it."""
    record = {"format": FORMAT, "path": path, "version": version, "kind": kind, "sha256": digest, "file_sha256": file["sha256"], "bytes": file["bytes"],
              "nonce": nonce(salt, path, version, digest), "at": time.time(), **meta}
    data = json.dumps(record, sort_keys=True).encode()
    run.store.write(f"{version_key(run, path, version)}/policy.json", data)
    run.store.write(f"{run.policy(path)}/latest.json", data)
    return record


def publish(run: Run, path: str, version: int, model: torch.nn.Module, salt: str, **meta: Any) -> dict[str, Any]:
    """Write a full policy version `version` (fp32 weights, then policy.json), then point latest.json at it."""
    return publish_tensors(run, path, version, weights(model), salt, **meta)


def publish_tensors(run: Run, path: str, version: int, state: dict[str, torch.Tensor], salt: str, **meta: Any) -> dict[str, Any]:
    """`publish` of a model's `weights` already taken."""
    file = write_tensors(run.store, f"{version_key(run, path, version)}/{FILES['full']}", state, compress=False)
    return _record(run, path, version, salt, "full", state_digest(state), file, snapshot=version, **meta)


class VersionWriter:
    """The trainer's side: each version a full snapshot, a delta against the last one (a full
    fine-tune, `snapshot_every` > 0), or the adapter (a LoRA unit)."""

    def __init__(self, run: Run, path: str, salt: str, snapshot_every: int, lora: LoraSpec | None = None, make_base: Callable[[], torch.nn.Module] | None = None):
        self.run, self.path, self.salt, self.snapshot_every, self.lora, self.make_base = run, path, salt, snapshot_every, lora, make_base
        self.published: dict[str, torch.Tensor] | None = None  # what workers rebuild from the last version this writer published
        self.state: dict[str, torch.Tensor] | None = None  # the tensors the last version stands for (its sha256's), until the next publish or optimizer step; None for an adapter
        self.last: dict[str, Any] | None = None
        self.base: dict[str, Any] | None = None

    def publish(self, version: int, model: torch.nn.Module, **meta: Any) -> dict[str, Any]:
        if self.lora is not None:
            return self._adapter(version, model, **meta)
        last = self.last
        if self.snapshot_every == 0 or last is None or self.published is None or version != last["version"] + 1 or version - last["snapshot"] >= self.snapshot_every:
            state = weights(model)
            record = publish_tensors(self.run, self.path, version, state, self.salt, **meta)
            self.published = {k: v.clone() for k, v in state.items()} if self.snapshot_every else None
            self.state = state
        else:
            delta = encode_delta(weights(model), self.published)
            file = write_tensors(self.run.store, f"{version_key(self.run, self.path, version)}/{FILES['delta']}", delta, compress=True)
            record = _record(self.run, self.path, version, self.salt, "delta", state_digest(self.published), file, parent=last["version"], parent_sha256=last["sha256"],
                             snapshot=last["snapshot"], **meta)
            self.state = self.published  # what a worker rebuilds, the tensors its sha256 names
        self.last = record
        return record

    def _adapter(self, version: int, model: torch.nn.Module, **meta: Any) -> dict[str, Any]:
        assert self.lora is not None and self.make_base is not None
        self.state = None
        if self.base is None:  # the frozen base, once (content-addressed: a restarted trainer finds it)
            state = weights(self.make_base())
            digest = state_digest(state)
            key = f"{self.run.policy(self.path)}/base-{digest[:16]}"
            if not self.run.store.exists(f"{key}/base.json"):
                file = write_tensors(self.run.store, f"{key}/model.safetensors", state, compress=False)
                self.run.store.write(f"{key}/base.json", json.dumps({"sha256": digest, "file_sha256": file["sha256"], "bytes": file["bytes"]}, sort_keys=True).encode())
            self.base = {"key": key, **json.loads(self.run.store.read(f"{key}/base.json"))}
            del state
        adapter = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in adapter_state(model).items()}  # bf16: the sampler's copy, half the bytes
        file = write_tensors(self.run.store, f"{version_key(self.run, self.path, version)}/{FILES['adapter']}", adapter, compress=False)
        digest = adapter_digest(self.base["sha256"], file["sha256"], self.lora.scale)
        self.last = _record(self.run, self.path, version, self.salt, "adapter", digest, file, base=self.base["key"], base_sha256=self.base["sha256"],
                            base_file_sha256=self.base["file_sha256"], scale=self.lora.scale, snapshot=version, **meta)
        return self.last


def latest(run: Run, path: str) -> dict[str, Any] | None:
    """latest.json of a path's policy, or None before the trainer published one."""
    try:
        return json.loads(run.store.read(f"{run.policy(path)}/latest.json"))
    except NotFound:
        return None


def version_record(run: Run, path: str, version: int) -> dict[str, Any] | None:
    """policy.json of a version, or None when it was never published (or is pruned)."""
    try:
        return json.loads(run.store.read(f"{version_key(run, path, version)}/policy.json"))
    except NotFound:
        return None


class PolicyReader:
    """A worker's (or the verifier's) side: loads versions into one model, applying a delta to the
    version before it when that is what the model holds, else rebuilding from the chain's
    snapshot; every result checked against the version's sha256."""

    def __init__(self, run: Run, path: str, model: torch.nn.Module):
        self.run, self.path, self.model = run, path, model
        self.held: dict[str, Any] | None = None  # the record of what the model holds
        self._base: tuple[str, dict[str, torch.Tensor]] | None = None

    def load(self, version: int) -> dict[str, Any]:
        record = self._record(version)
        kind = record.get("kind", "full")
        if kind == "adapter":
            self._load_adapter(record)
        elif kind == "delta":
            chain = [record]  # back to a version the model holds, or to the chain's snapshot
            while not self._holds_parent(chain[-1]) and int(chain[-1]["parent"]) > int(chain[-1]["snapshot"]):
                chain.append(self._record(int(chain[-1]["parent"])))
            if not self._holds_parent(chain[-1]):
                self._load_full(self._record(int(chain[-1]["snapshot"])))
            for link in reversed(chain):
                self.held = None  # half-applied until checked
                apply_delta(self.model.state_dict(), self._file(link))
                self._check(link)
                self.held = link
        else:
            self._load_full(record)
        self.held = record
        return record

    def _holds_parent(self, record: dict[str, Any]) -> bool:
        return self.held is not None and self.held.get("sha256") == record["parent_sha256"] and self.held["version"] == record["parent"]

    def _record(self, version: int) -> dict[str, Any]:
        record = version_record(self.run, self.path, version)
        if record is None:
            raise NotFound(f"policy version {version} of {self.path} is not in {self.run.url} (pruned, or never published): read latest.json again")
        return record

    def _file(self, record: dict[str, Any]) -> dict[str, torch.Tensor]:
        kind = record.get("kind", "full")
        key = f"{version_key(self.run, self.path, int(record['version']))}/{FILES[kind]}"
        return read_tensors(self.run.store, key, record.get("file_sha256", record["sha256"]), compress=kind == "delta")

    def hold(self, record: dict[str, Any], tensors: dict[str, torch.Tensor], check: bool = False) -> None:
        """Put version `record`'s `tensors` into the model (checked against its sha256 with
        `check`; unchecked only for tensors the caller trusts, e.g. a trainer's own copy of what it
        published); a delta after it then applies to them."""
        self.held = None  # half-assigned until done
        assign(self.model, tensors)
        if check:
            self._check(record)
        self.held = record

    def _load_full(self, record: dict[str, Any]) -> None:
        self.hold(record, self._file(record), check="kind" in record)  # versions before deltas named their file's sha256 only (checked on read)

    def _load_adapter(self, record: dict[str, Any]) -> None:
        if adapter_digest(record["base_sha256"], record["file_sha256"], record["scale"]) != record["sha256"]:
            raise DataError(f"policy version {record['version']} of {self.path} names a base, an adapter or a scale other than its sha256 covers: read latest.json again")
        if self._base is None or self._base[0] != record["base_sha256"]:
            base = read_tensors(self.run.store, f"{record['base']}/model.safetensors", record["base_file_sha256"], compress=False)
            if state_digest(base) != record["base_sha256"]:
                raise DataError(f"{self.run.store.url_of(record['base'])} does not hold the base its policy versions name: the trainer writes it again when it restarts")
            self._base = (record["base_sha256"], base)
        self.held = None
        assign(self.model, merge(self._base[1], self._file(record), float(record["scale"])))

    def _check(self, record: dict[str, Any]) -> None:
        if state_digest(weights(self.model)) != record["sha256"]:
            raise DataError(f"policy version {record['version']} of {self.path} rebuilt to other weights than its policy.json names: read latest.json again")


def load_version(run: Run, path: str, version: int, model: torch.nn.Module) -> dict[str, Any]:
    """Load version `version` into `model` (from its snapshot, for a delta), checked against policy.json."""
    return PolicyReader(run, path, model).load(version)


def published_versions(run: Run, path: str) -> list[int]:
    return sorted(int(o.key.split("/")[2][1:]) for o in run.store.list(run.policy(path)) if o.key.endswith("/policy.json"))


def prune(run: Run, path: str, keep: Callable[[int], bool]) -> int:
    """Delete the versions `keep` says nobody may use any more, but never a version a kept delta is
    rebuilt from (its chain back to its snapshot); how many."""
    versions = published_versions(run, path)
    needed = {v for v in versions if keep(v)}
    for v in sorted(needed):
        record = version_record(run, path, v) or {}
        if record.get("kind") == "delta":
            needed.update(range(int(record["snapshot"]), v))
    gone = 0
    for v in versions:
        if v not in needed:
            run.store.delete(f"{version_key(run, path, v)}/policy.json")  # the marker first: a half-deleted version does not exist
            for name in FILES.values():
                run.store.delete(f"{version_key(run, path, v)}/{name}")
            gone += 1
    return gone


def sampler(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """The model as a rollout worker samples with it: fp32, bf16 weights, or int8 dynamically
    quantized linear layers and experts (QuaRL: an 8-bit actor, a full-precision learner; see
    quantize.py). A copy for int8."""
    if dtype == "fp32":
        return model.float()
    if dtype == "bf16":
        return model.to(torch.bfloat16)
    if dtype == "int8":
        return int8_copy(model)
    raise ConfigurationError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def copy_as(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """The fp32 `model` as a sampler of `dtype` computes, leaving `model` itself fp32 (a copy for
    bf16 and int8)."""
    if dtype == "fp32":
        return model
    if dtype == "int8":
        return int8_copy(model)
    return copy.deepcopy(model).to(torch.bfloat16)


class PolicyPublisher(Callback):
    """Publishes the trainer's weights as policy version <step> when it starts and after every
    optimizer step, and prunes every version but the last max_async + 1 and those a trainer
    resumed from the last checkpoint may need (its step minus max_async, up to it). `source` (the
    trainer's StoreRollouts) holds the salt and learns of every record published."""

    def __init__(self, run: Run, path: str, max_async: int, source: Any, needs: int = 1, snapshot_every: int = 0, lora: LoraSpec | None = None,
                 make_base: Callable[[], torch.nn.Module] | None = None):
        self.run, self.path, self.max_async, self.source, self.needs = run, path, max_async, source, needs
        self.writer = VersionWriter(run, path, source.salt, snapshot_every, lora, make_base)
        self.checkpointed = 0
        source.on_starving = self.starving

    def starving(self) -> None:
        """latest.json again with pending 0: the trainer waits, the workers may sample."""
        head = latest(self.run, self.path)
        if head is not None:
            heard = self.source.waiting()[1]
            self.run.store.write(f"{self.run.policy(self.path)}/latest.json", json.dumps({**head, "pending": 0, "heard": heard, "at": time.time()}, sort_keys=True).encode())

    def _publish(self, trainer: Any) -> None:
        self.writer.salt = self.source.salt  # a resumed trainer's (restored with its state)
        pending, heard = self.source.waiting()
        record = self.writer.publish(trainer.step, trainer.unwrapped, max_async=self.max_async, step=trainer.step, pending=pending, heard=heard, needs=self.needs,
                                     mixture=self.source.cfg.mixture)
        self.source.published(record, self.writer.state)

    def started(self, trainer: Any) -> None:
        self.checkpointed = self.source.started_at = trainer.step
        for v in published_versions(self.run, self.path):  # a trainer before this one may have published them: its workers' batches are stale, not lies
            record = version_record(self.run, self.path, v)
            if record is not None:
                self.source.published(record)
        if version_record(self.run, self.path, trainer.step) is None or (latest(self.run, self.path) or {}).get("version") != trainer.step:
            self._publish(trainer)

    def stepped(self, trainer: Any, record: dict[str, Any]) -> None:
        self._publish(trainer)
        k, step, ckpt = self.max_async, trainer.step, self.checkpointed
        prune(self.run, self.path, lambda v: v >= step - k or ckpt - k <= v <= ckpt)  # what this trainer, or one resumed from its checkpoint, may still check

    def committed(self, trainer: Any, step: int) -> None:
        self.checkpointed = step
