"""Policy versions: what the asynchronous trainer publishes after each step, and workers sample from.

    policy/<path>/v<N>/model.safetensors   the weights (fp32)
    policy/<path>/v<N>/policy.json         their sha256 and the version's nonce; written last, so a
                                           version exists once its policy.json does
    policy/<path>/latest.json              the newest version's record (+ how many batches wait)

The nonce is the trainer's: HMAC of its secret salt over the path, version and weights' sha256
(seeds.nonce). Every sample of the version is drawn with numbers derived from it.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any, Callable

import torch

from paths.errors import ConfigurationError, DataError, NotFound
from paths.trainer import Callback
from paths.work.quantize import int8_copy
from paths.work.rollouts.batch import DTYPES, FORMAT, sha256
from paths.work.rollouts.seeds import nonce
from storage.layout import Run


def version_key(run: Run, path: str, version: int) -> str:
    return f"{run.policy(path)}/v{version:08d}"


def publish(run: Run, path: str, version: int, model: torch.nn.Module, salt: str, **meta: Any) -> dict[str, Any]:
    """Write policy version `version` (weights, then policy.json with their sha256 and the nonce),
    then point latest.json at it."""
    from safetensors.torch import save

    prefix = version_key(run, path, version)
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    data = save(state)
    digest = sha256(data)
    run.store.write(f"{prefix}/model.safetensors", data)
    record = {"format": FORMAT, "path": path, "version": version, "sha256": digest, "nonce": nonce(salt, path, version, digest), "bytes": len(data), "at": time.time(), **meta}
    run.store.write(f"{prefix}/policy.json", json.dumps(record, sort_keys=True).encode())
    run.store.write(f"{run.policy(path)}/latest.json", json.dumps(record, sort_keys=True).encode())
    return record


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


def load_version(run: Run, path: str, version: int, model: torch.nn.Module) -> dict[str, Any]:
    """Load version `version` into `model`, its bytes checked against policy.json."""
    from safetensors.torch import load

    record = version_record(run, path, version)
    if record is None:
        raise NotFound(f"policy version {version} of {path} is not in {run.url} (pruned, or never published): read latest.json again")
    data = run.store.read(f"{version_key(run, path, version)}/model.safetensors")
    if sha256(data) != record["sha256"]:
        raise DataError(f"{run.store.url_of(version_key(run, path, version))}/model.safetensors does not match its policy.json checksum: the trainer publishes it again next step")
    model.load_state_dict(load(data), strict=True)
    return record


def published_versions(run: Run, path: str) -> list[int]:
    return sorted(int(o.key.split("/")[2][1:]) for o in run.store.list(run.policy(path)) if o.key.endswith("/policy.json"))


def prune(run: Run, path: str, keep: Callable[[int], bool]) -> int:
    """Delete the versions `keep` says nobody may use any more; how many."""
    gone = 0
    for v in published_versions(run, path):
        if not keep(v):
            run.store.delete(f"{version_key(run, path, v)}/policy.json")  # the marker first: a half-deleted version does not exist
            run.store.delete(f"{version_key(run, path, v)}/model.safetensors")
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

    def __init__(self, run: Run, path: str, max_async: int, source: Any, needs: int = 1):
        self.run, self.path, self.max_async, self.source, self.needs = run, path, max_async, source, needs
        self.checkpointed = 0
        source.on_starving = self.starving

    def starving(self) -> None:
        """latest.json again with pending 0: the trainer waits, the workers may sample."""
        head = latest(self.run, self.path)
        if head is not None:
            self.run.store.write(f"{self.run.policy(self.path)}/latest.json", json.dumps({**head, "pending": 0, "at": time.time()}, sort_keys=True).encode())

    def _publish(self, trainer: Any) -> None:
        record = publish(self.run, self.path, trainer.step, trainer.unwrapped, self.source.salt, max_async=self.max_async, step=trainer.step, pending=self.source.pending, needs=self.needs,
                         mixture=self.source.cfg.mixture)
        self.source.published(record)

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
