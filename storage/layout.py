"""The layout of a run (DESIGN.md, Storage) as one object with named locations, and run.json.

```
run.json                     format version, plan, base model, families, tokenizer
base/  tokenizer/            the decomposed MoE checkpoint and the shared tokenizer
paths/<path>/path.json       a path (no weights); paths/<path>/init/ optional dense copy
router/<name>/               a routing model
data/<dataset>/manifest.json data/<dataset>/<path>.zarr
claims/<path>.json           leases (conditional writes only)
work/<path>/ckpt-<step>/     checkpoints (committed once COMMITTED exists); work/<path>/final/
composed/<name>/             composed checkpoints (composed/round-<r>/: a DiLoCo round's outer step)
diloco/r<r>/<path>/          a path's weights at the end of DiLoCo round r; diloco/r<r>/outer.json
policy/<path>/v<N>/          policy versions an asynchronous trainer publishes; policy/<path>/latest.json
rollouts/<path>/batches/<worker>/<batch>.safetensors   rollout batches (create-only); rollouts/<path>/rejected/
```
"""

from __future__ import annotations

import json
import re
import time
from importlib import metadata
from typing import Any

from storage.errors import ConfigurationError, FormatVersionError, IntegrityError, NotFound
from storage.store import Store
from storage.url import open_store

FORMAT_VERSION = 1
RUN_JSON = "run.json"
COMMITTED = "COMMITTED"
_NAME = re.compile(r"[A-Za-z0-9._-]+")
_CKPT = re.compile(r"ckpt-(\d+)")


def validate_name(kind: str, name: str) -> str:
    """A name used inside keys: letters, digits, '.', '_', '-'; no '..'; not empty."""
    if not name or not _NAME.fullmatch(name) or ".." in name or name.startswith("."):
        raise ConfigurationError(
            f"invalid {kind} name {name!r}: use letters, digits, '.', '_' and '-' "
            "(no '/', no '..', not empty, not starting with '.')"
        )
    return name


class Run:
    """A run's store plus the named locations of everything in it."""

    def __init__(self, store: Store):
        self.store = store

    def __repr__(self) -> str:
        return f"Run({self.url!r})"

    @property
    def url(self) -> str:
        """The run's root URL."""
        return self.store.url

    # -- named locations (keys relative to the run root) -----------------------------------------
    base = "base"
    tokenizer = "tokenizer"

    def path_dir(self, path_id: str) -> str:
        """paths/<path>/"""
        return f"paths/{validate_name('path', path_id)}"

    def path_json(self, path_id: str) -> str:
        """paths/<path>/path.json"""
        return f"{self.path_dir(path_id)}/path.json"

    def path_init(self, path_id: str) -> str:
        """paths/<path>/init/ — optional standalone dense checkpoint."""
        return f"{self.path_dir(path_id)}/init"

    def expert(self, name: str) -> str:
        """experts/<name>/ — a domain expert: expert.json and its starting weights in init/."""
        return f"experts/{validate_name('expert', name)}"

    def router(self, name: str) -> str:
        """router/<name>/"""
        return f"router/{validate_name('router', name)}"

    def dataset(self, name: str) -> str:
        """data/<dataset>/"""
        return f"data/{validate_name('dataset', name)}"

    def dataset_manifest(self, name: str) -> str:
        """data/<dataset>/manifest.json"""
        return f"{self.dataset(name)}/manifest.json"

    def shard(self, dataset: str, path_id: str) -> str:
        """data/<dataset>/<path>.zarr"""
        return f"{self.dataset(dataset)}/{validate_name('path', path_id)}.zarr"

    def claim(self, path_id: str) -> str:
        """claims/<path>.json"""
        return f"claims/{validate_name('path', path_id)}.json"

    def work(self, path_id: str) -> str:
        """work/<path>/"""
        return f"work/{validate_name('path', path_id)}"

    def checkpoint(self, path_id: str, step: int) -> str:
        """work/<path>/ckpt-<step>/"""
        if step < 0:
            raise ConfigurationError(f"checkpoint step must be >= 0, got {step}")
        return f"{self.work(path_id)}/ckpt-{step}"

    def final(self, path_id: str) -> str:
        """work/<path>/final/"""
        return f"{self.work(path_id)}/final"

    def policy(self, path_id: str) -> str:
        """policy/<path>/: the policy versions of an asynchronous GRPO trainer (v<N>/, latest.json)."""
        return f"policy/{validate_name('path', path_id)}"

    def rollouts(self, path_id: str) -> str:
        """rollouts/<path>/: batches/<worker>/<batch>.safetensors from rollout workers, rejected/."""
        return f"rollouts/{validate_name('path', path_id)}"

    def allowlist(self) -> str:
        """workers/allowlist.json: the rollout workers' public keys the run's owner admitted."""
        return "workers/allowlist.json"

    def diloco(self, round_: int, path_id: str | None = None) -> str:
        """diloco/r<r>/ (a DiLoCo round), or diloco/r<r>/<path>/: the path's weights at its end."""
        if round_ < 1:
            raise ConfigurationError(f"DiLoCo rounds count from 1, got {round_}")
        return f"diloco/r{round_}" + (f"/{validate_name('path', path_id)}" if path_id else "")

    def composed(self, name: str) -> str:
        """composed/<name>/"""
        return f"composed/{validate_name('composed model', name)}"

    # -- run.json -------------------------------------------------------------------------------
    def read_meta(self) -> dict[str, Any]:
        """run.json, refusing unreadable files and newer format versions."""
        where = self.store.url_of(RUN_JSON)
        try:
            raw = self.store.read(RUN_JSON)
        except NotFound:
            raise NotFound(
                f"{self.url} is not a paths run (no run.json): create one with "
                f"`paths storage init {self.url}`"
            ) from None
        try:
            meta = json.loads(raw)
            version = meta["format_version"]
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(
                f"{where} is unreadable ({type(exc).__name__}: {exc}): restore it from a copy"
            ) from None
        if not isinstance(version, int) or version < 1:
            raise IntegrityError(f"{where} has an invalid format_version {version!r}: restore it")
        if version > FORMAT_VERSION:
            raise FormatVersionError(
                f"{where} was written by a newer paths (format {version}; this one reads up to "
                f"{FORMAT_VERSION}): upgrade paths"
            )
        return meta

    def write_meta(self, meta: dict[str, Any]) -> None:
        """Write run.json atomically, stamping the format version."""
        meta = {**meta, "format": "paths-run", "format_version": FORMAT_VERSION}
        self.store.write(RUN_JSON, json.dumps(meta, indent=2, sort_keys=True).encode() + b"\n")

    def update_meta(self, **fields: Any) -> dict[str, Any]:
        """Merge fields into run.json."""
        meta = {**self.read_meta(), **fields}
        self.write_meta(meta)
        return meta

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoints(self, path_id: str) -> list[tuple[int, bool]]:
        """(step, committed) of every checkpoint folder of a path, oldest first."""
        found: dict[int, bool] = {}
        prefix = self.work(path_id) + "/"
        for obj in self.store.list(self.work(path_id)):
            head = obj.key[len(prefix):].split("/", 1)
            m = _CKPT.fullmatch(head[0])
            if m:
                step = int(m.group(1))
                found[step] = found.get(step, False) or (len(head) > 1 and head[1] == COMMITTED)
        return sorted(found.items())


def parse_checkpoint(name: str) -> int | None:
    """The step of a 'ckpt-<step>' folder name, else None."""
    m = _CKPT.fullmatch(name)
    return int(m.group(1)) if m else None


def open_run(
    url: str, storage_options: dict[str, Any] | None = None, *, create: bool = False
) -> Run:
    """The run at url (local folder, s3://bucket/prefix, memory://...).

    With `create`, make the folder or bucket and write run.json if absent; without it, the run
    must exist and its run.json must be readable by this version.
    """
    run = Run(open_store(url, storage_options, create=create))
    if create and not run.store.exists(RUN_JSON):
        run.write_meta({"created_at": time.time(), "created_by": f"paths {_version()}"})
    run.read_meta()
    return run


def _version() -> str:
    try:
        return metadata.version("paths")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"
