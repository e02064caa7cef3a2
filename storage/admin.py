"""What `paths storage` does: usage, verification, garbage collection and lease listings."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from storage.errors import ConfigurationError, IntegrityError
from storage.layout import COMMITTED, Run, open_run, parse_checkpoint
from storage.manifest import MANIFEST, Problem, verify_manifest
from storage.store import HIDDEN_PREFIX, ObjectInfo, is_hidden, stale_lock


def path_of(key: str) -> str | None:
    """The path (or expert) id an object belongs to, if any, from the run layout."""
    parts = key.split("/")
    if parts[0] in ("paths", "work", "policy", "rollouts") and len(parts) > 2:
        return parts[1]
    if parts[0] == "claims" and len(parts) == 2 and parts[1].endswith(".json"):
        return parts[1][: -len(".json")]
    if parts[0] == "data" and len(parts) > 3 and parts[2].endswith(".zarr"):
        return parts[2][: -len(".zarr")]
    return None


@dataclass(slots=True)
class Usage:
    """Bytes and objects, per area and per path."""

    total_bytes: int = 0
    total_objects: int = 0
    areas: dict[str, list[int]] = field(default_factory=dict)  # area -> [bytes, objects]
    paths: dict[str, list[int]] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        pair = lambda d: {k: {"bytes": b, "objects": n} for k, (b, n) in sorted(d.items())}
        return {
            "bytes": self.total_bytes,
            "objects": self.total_objects,
            "areas": pair(self.areas),
            "paths": pair(self.paths),
        }


def du(run: Run) -> Usage:
    """Disk usage of a run by area (top-level folder) and by path."""
    usage = Usage()
    for obj in run.store.list():
        area = obj.key.split("/", 1)[0] if "/" in obj.key else "(root)"
        usage.total_bytes += obj.size
        usage.total_objects += 1
        a = usage.areas.setdefault(area, [0, 0])
        a[0] += obj.size
        a[1] += 1
        pid = path_of(obj.key)
        if pid is not None:
            p = usage.paths.setdefault(pid, [0, 0])
            p[0] += obj.size
            p[1] += 1
    return usage


def ls(run: Run, prefix: str = "") -> list[ObjectInfo]:
    """Objects under a prefix of the run."""
    return run.store.list(prefix)


@dataclass(slots=True)
class VerifyReport:
    """What `verify` checked and what failed."""

    manifests: int = 0
    files: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return not self.problems

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "ok": self.ok,
            "manifests": self.manifests,
            "files": self.files,
            "problems": [asdict(p) for p in self.problems],
        }


def verify(run: Run) -> VerifyReport:
    """Recompute the sha256 of every file listed in every manifest of the run; check checkpoints
    marked COMMITTED have a manifest."""
    report = VerifyReport()
    keys = [o.key for o in run.store.list()]
    for key in keys:
        if key == MANIFEST or key.endswith("/" + MANIFEST):
            prefix = key[: -len(MANIFEST)].rstrip("/")
            checked, problems = verify_manifest(run.store, prefix)
            report.manifests += 1
            report.files += checked
            report.problems += problems
    key_set = set(keys)
    for key in keys:
        if key.endswith("/" + COMMITTED):
            folder = key[: -len(COMMITTED) - 1]
            if f"{folder}/{MANIFEST}" not in key_set:
                report.problems.append(
                    Problem(f"{folder}/{MANIFEST}", "missing", "committed checkpoint has no manifest")
                )
    return report


def parse_duration(text: str) -> float:
    """Seconds in '90', '90s', '30m', '2h', '7d'."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    try:
        if t and t[-1] in units:
            return float(t[:-1]) * units[t[-1]]
        return float(t)
    except ValueError:
        raise ConfigurationError(f"invalid duration {text!r}: use seconds or 30m, 2h, 7d") from None


@dataclass(frozen=True, slots=True)
class GcItem:
    """A folder or object that gc removes, and why."""

    key: str
    reason: str
    objects: int
    bytes: int


def gc_plan(run: Run, older_than_s: float, keep: int, now: float | None = None) -> list[GcItem]:
    """What gc would remove: uncommitted checkpoints older than the cut-off, committed ones beyond
    the newest `keep` per path, and stale temp files of interrupted local writes."""
    if keep < 1:
        raise ConfigurationError(f"--keep must be at least 1 (got {keep}): gc never removes the newest checkpoint")
    now = time.time() if now is None else now
    folders: dict[str, list[ObjectInfo]] = {}
    for obj in run.store.list("work"):
        parts = obj.key.split("/")
        if len(parts) >= 4 and parse_checkpoint(parts[2]) is not None:
            folders.setdefault("/".join(parts[:3]), []).append(obj)
    by_path: dict[str, list[tuple[int, str]]] = {}
    plan: list[GcItem] = []
    for folder, objs in sorted(folders.items()):
        committed = any(o.key == f"{folder}/{COMMITTED}" for o in objs)
        size, n = sum(o.size for o in objs), len(objs)
        if committed:
            pid, name = folder.split("/")[1:3]
            by_path.setdefault(pid, []).append((parse_checkpoint(name) or 0, folder))
            continue
        newest = max((o.mtime or now) for o in objs)
        if now - newest >= older_than_s:
            plan.append(GcItem(folder, f"uncommitted, idle {_age(now - newest)}", n, size))
    for pid, ckpts in sorted(by_path.items()):
        for step, folder in sorted(ckpts)[:-keep]:
            objs = folders[folder]
            plan.append(GcItem(folder, f"committed, older than the newest {keep}", len(objs), sum(o.size for o in objs)))
    plan += _finished_async(run, older_than_s, now)
    plan += _stale_temp_files(run, older_than_s, now)
    return plan


def _finished_async(run: Run, older_than_s: float, now: float) -> list[GcItem]:
    """What asynchronous RL leaves once a path's training is finished (work/<path>/final/
    committed): policy versions but the latest (and the chain or the adapter base it needs), and rollout batches idle past the cut-off (the
    rejection records stay)."""
    groups: dict[str, list[ObjectInfo]] = {}
    for area in ("policy", "rollouts"):
        for obj in run.store.list(area):
            parts = obj.key.split("/")
            if area == "policy" and len(parts) == 4 and (parts[2].startswith("v") or parts[2].startswith("base-")):
                groups.setdefault("/".join(parts[:3]), []).append(obj)
            elif area == "rollouts" and len(parts) >= 4 and parts[2] == "batches":
                groups.setdefault("/".join(parts[:3]), []).append(obj)
    out = []
    latest: dict[str, set[str]] = {}
    for folder, objs in sorted(groups.items()):
        area, pid = folder.split("/")[:2]
        if not run.store.exists(f"work/{pid}/final/{MANIFEST}"):
            continue  # still training: the trainer prunes its own versions
        size, n = sum(o.size for o in objs), len(objs)
        if area == "policy":
            if pid not in latest:
                try:  # the latest version, and the chain it is rebuilt from when it is a delta
                    head = json.loads(run.store.read(f"policy/{pid}/latest.json"))
                    latest[pid] = {"v%08d" % v for v in range(int(head.get("snapshot", head["version"])), int(head["version"]) + 1)} | {str(head.get("base", "")).rsplit("/", 1)[-1]}
                except Exception:
                    latest[pid] = set()
            if folder.split("/")[2] not in latest[pid]:
                out.append(GcItem(folder, "policy version of a finished path (not the latest)" if folder.split("/")[2].startswith("v") else "adapter base no version of a finished path names", n, size))
        elif now - max((o.mtime or now) for o in objs) >= older_than_s:
            out.append(GcItem(folder, f"rollout batches of a finished path, idle {_age(now - max((o.mtime or now) for o in objs))}", n, size))
    return out


def _stale_temp_files(run: Run, older_than_s: float, now: float) -> list[GcItem]:
    """What local writes leave behind: temp files, scratch folders and staged artifacts of
    interrupted writes (hidden from listings) and folders left empty, idle past the cut-off; and
    lock files of holders killed before they removed them (nobody holds them: removed at once)."""
    if run.store.protocol != "file":
        return []
    root = run.store.root
    out, holding = [], set()  # holding: folders with a file somewhere beneath
    for folder, subfolders, files in os.walk(root, topdown=False):
        rel = os.path.relpath(folder, root).replace(os.sep, "/")
        for name in files:
            key = name if rel == "." else f"{rel}/{name}"
            try:
                info = os.stat(os.path.join(folder, name))
            except FileNotFoundError:
                continue  # a live writer renamed or removed it meanwhile
            if name.startswith(HIDDEN_PREFIX + "lock-"):
                out.append(GcItem(key, "lock file of a killed holder", 1, info.st_size))
                continue
            holding.add(folder)
            age = now - info.st_mtime
            if is_hidden(key) and age >= older_than_s:
                out.append(GcItem(key, f"temp file, {_age(age)} old", 1, info.st_size))
        if folder in holding or any(os.path.join(folder, d) in holding for d in subfolders):
            holding.add(folder)
        elif rel != "." and now - _mtime_of(folder, now) >= older_than_s:
            out.append(GcItem(rel, "empty folder", 0, 0))
    return out


def gc_apply(run: Run, plan: list[GcItem]) -> int:
    """Remove what the plan lists, and on a local folder the folders that leaves empty; returns
    objects removed."""
    removed = 0
    local = run.store.protocol == "file"
    for item in plan:
        path = f"{run.store.root}/{item.key}"
        if item.reason.startswith("temp file"):
            run.store.fs.rm_file(path)
            removed += 1
        elif item.reason.startswith("lock file"):
            removed += int(stale_lock(path))  # unless someone took it meanwhile
        elif item.reason == "empty folder":
            _remove_empty(run.store.root, path)
        else:
            removed += run.store.delete_prefix(item.key)
        if local:
            _remove_empty(run.store.root, os.path.dirname(path) if item.reason.startswith(("temp file", "lock file")) else path)
    return removed


def _mtime_of(path: str, default: float) -> float:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return default


def _remove_empty(root: str, folder: str) -> None:
    """Remove `folder` and then its parents, up to (not including) `root`, while they are empty."""
    for f in (os.path.join(d, n) for d, subs, _ in os.walk(folder, topdown=False) for n in subs):
        try:
            os.rmdir(f)
        except OSError:
            pass
    while os.path.abspath(folder).startswith(os.path.abspath(root) + os.sep):
        try:
            os.rmdir(folder)
        except OSError:
            return  # not empty, or gone
        folder = os.path.dirname(folder)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def claims(run: Run) -> list[dict[str, Any]]:
    """Every lease record under claims/, with `expired` computed now."""
    out = []
    now = time.time()
    for obj in run.store.list("claims"):
        if not obj.key.endswith(".json"):
            continue
        try:
            record = json.loads(run.store.read(obj.key))
        except ValueError as exc:
            raise IntegrityError(f"{run.store.url_of(obj.key)} is not valid JSON ({exc}): release it with `paths storage release`") from None
        record.setdefault("path", obj.key[len("claims/") : -len(".json")])
        expires = record.get("expires_at")
        record["expired"] = bool(record.get("state") == "claimed" and expires is not None and expires < now)
        out.append(record)
    return out


def init(url: str, storage_options: dict[str, Any] | None = None) -> Run:
    """Create the bucket or folder if absent and write the layout marker (run.json)."""
    return open_run(url, storage_options, create=True)
