"""sha256 manifests: every artifact folder lists its files with size and hash, written last.

A folder's `manifest.json` has a `files` map {relative name: {"bytes": n, "sha256": hex}} and any
other fields its writer wants (provenance, per-path counts). Because it is written after the files,
a reader that finds the manifest finds every file it lists (MosaicML streaming's index-last rule).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from storage.errors import IntegrityError, NotFound, PreconditionFailed, StorageError
from storage.store import Store

MANIFEST = "manifest.json"


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of bytes."""
    return hashlib.sha256(data).hexdigest()


def sha256_of(store: Store, key: str) -> str:
    """Hex sha256 of a stored object, streamed in chunks."""
    h = hashlib.sha256()
    for block in store.iter_chunks(key):
        h.update(block)
    return h.hexdigest()


def upload_file(store: Store, key: str, local_path: str, move: bool = False) -> dict[str, Any]:
    """Copy (or move) a local file to a key; its manifest entry {"bytes", "sha256"}."""
    h, n = hashlib.sha256(), 0
    with open(local_path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
            n += len(block)
    (store.move_in if move else store.upload)(key, local_path)
    return {"bytes": n, "sha256": h.hexdigest()}


def _join(prefix: str, name: str) -> str:
    return f"{prefix.rstrip('/')}/{name}" if prefix else name


@dataclass(slots=True)
class ArtifactWriter:
    """Write files under a prefix, then `commit()` the manifest that lists them (last)."""

    store: Store
    prefix: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def write(self, name: str, data: bytes) -> None:
        """Write one file atomically and record its size and hash."""
        self.store.write(_join(self.prefix, name), data)
        self.files[name] = {"bytes": len(data), "sha256": sha256_hex(data)}

    def write_json(self, name: str, obj: Any) -> None:
        """Write a JSON file (sorted keys, so equal content gives equal bytes)."""
        self.write(name, json.dumps(obj, indent=2, sort_keys=True).encode() + b"\n")

    def upload(self, name: str, local_path: str, move: bool = False) -> None:
        """Copy (or with `move`, rename when possible) a local file in; record its size and hash."""
        self.files[name] = upload_file(self.store, _join(self.prefix, name), local_path, move)

    def commit(self, **extra: Any) -> dict[str, Any]:
        """Write manifest.json; until then, readers treat the artifact as absent."""
        manifest = {"files": dict(sorted(self.files.items())), "written_at": time.time(), **extra}
        body = json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"
        self.store.write(_join(self.prefix, MANIFEST), body)
        return manifest


def read_manifest(store: Store, prefix: str) -> dict[str, Any]:
    """The manifest of an artifact folder; NotFound if it was never committed."""
    key = _join(prefix, MANIFEST)
    try:
        manifest = json.loads(store.read(key))
    except NotFound:
        raise NotFound(f"{store.url_of(key)} does not exist: the artifact was never committed") from None
    except ValueError as exc:
        raise IntegrityError(f"{store.url_of(key)} is not valid JSON ({exc}): restore or rewrite it") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
        raise IntegrityError(f"{store.url_of(key)} has no 'files' map: restore or rewrite it")
    return manifest


def read_verified(store: Store, prefix: str, name: str) -> bytes:
    """A file of a committed artifact, checked against its manifest entry."""
    entry = read_manifest(store, prefix).get("files", {}).get(name)
    key = _join(prefix, name)
    if entry is None:
        raise IntegrityError(f"{store.url_of(key)} is not listed in {store.url_of(_join(prefix, MANIFEST))}")
    data = store.read(key)
    check_entry(store, key, entry, len(data), sha256_hex(data))
    return data


def download(store: Store, prefix: str, out: str, names: Callable[[str], str | None] | None = None) -> dict[str, Any]:
    """Write the files of a committed artifact under `out`, each checked against the manifest
    (read once); `names` maps a listed name to where it goes under `out` (None: leave it out).
    Returns the manifest."""
    manifest = read_manifest(store, prefix)
    for name, entry in manifest["files"].items():
        target = names(name) if names else name
        if target is None:
            continue
        key = _join(prefix, name)
        data = store.read(key)
        check_entry(store, key, entry, len(data), sha256_hex(data))
        path = os.path.join(out, target)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return manifest


def check_entry(store: Store, key: str, entry: dict[str, Any], size: int, digest: str) -> None:
    """Raise IntegrityError naming the object when size or hash differ from the manifest."""
    if size != entry.get("bytes"):
        raise IntegrityError(
            f"{store.url_of(key)} has {size} bytes, its manifest says {entry.get('bytes')}: "
            "the object is truncated or was replaced; restore it"
        )
    if digest != entry.get("sha256"):
        raise IntegrityError(
            f"{store.url_of(key)} does not match the sha256 in its manifest: restore it"
        )


@dataclass(frozen=True, slots=True)
class Problem:
    """One failed check of `verify`."""

    key: str
    kind: str  # missing | size | sha256 | manifest
    detail: str


def verify_manifest(store: Store, prefix: str) -> tuple[int, list[Problem]]:
    """Recompute every file of one manifest; (files checked, problems)."""
    try:
        manifest = read_manifest(store, prefix)
    except StorageError as exc:
        return 0, [Problem(_join(prefix, MANIFEST), "manifest", str(exc))]
    problems, checked = [], 0
    for name, entry in manifest.get("files", {}).items():
        key = _join(prefix, name)
        checked += 1
        try:
            size = store.size(key)
            digest = sha256_of(store, key)
        except NotFound:
            problems.append(Problem(key, "missing", "listed in the manifest but not in the store"))
            continue
        try:
            check_entry(store, key, entry, size, digest)
        except IntegrityError as exc:
            kind = "size" if size != entry.get("bytes") else "sha256"
            problems.append(Problem(key, kind, str(exc)))
    return checked, problems


def install(store: Store, local_dir: str, prefix: str, overwrite: bool, json_files: dict[str, Any] | None = None, hashed: dict[str, dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    """Commit a finished local folder as the artifact at `prefix` (its files moved in, then the
    manifest with `extra`). With `overwrite`, an existing artifact stays whole until the new one is
    complete and committed beside it (a hidden staging prefix), then `Store.replace_prefix` swaps
    it in: a failure before the swap leaves the old artifact byte-identical. `hashed`: manifest
    entries of files hashed while they were written (not read again). Returns the manifest."""
    import uuid

    from storage.store import HIDDEN_PREFIX

    exists = store.exists(_join(prefix, MANIFEST))
    if exists and not overwrite:
        raise PreconditionFailed(f"{store.url_of(prefix)} already exists: pass --overwrite or choose another name")
    target = f"{HIDDEN_PREFIX}stage-{uuid.uuid4().hex[:12]}" if exists else prefix
    writer = ArtifactWriter(store, target)
    try:
        for name in _files_under(local_dir):
            local = os.path.join(local_dir, name)
            if hashed and name in hashed and hashed[name]["bytes"] == os.path.getsize(local):
                store.move_in(_join(target, name), local)
                writer.files[name] = dict(hashed[name])
            else:
                writer.upload(name, local, move=True)
        for name, obj in (json_files or {}).items():
            writer.write_json(name, obj)
        manifest = writer.commit(**extra)
        if exists:
            store.replace_prefix(target, prefix)
    except BaseException:
        if exists:  # the staged copy is ours alone: nothing of the old artifact was touched yet
            store.discard_staged(target)
        raise
    return manifest


def _files_under(folder: str) -> list[str]:
    """Every file under a folder, as sorted '/'-joined relative names."""
    out = []
    for root, _, files in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, f), folder).replace(os.sep, "/") for f in files]
    return sorted(out)
