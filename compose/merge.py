"""`paths compose --into moe`: merge trained paths back into one MoE checkpoint of the base family.

For each tensor of base/, the finished paths that contain it give deltas from the base: an expert
tensor of layer l, expert e comes from the paths whose choice at l's level is e (its dense MLP
tensor in the path); a shared tensor from every finished path; routers from none (kept). Then

    d = weighted mean of (path - base)            (outer gradient, negated)
    m = momentum * m_previous + d                 (state kept in composed/<name>/momentum.safetensors)
    new = base + outer_lr * (d + momentum * m)    (Nesterov; with momentum 0: base + outer_lr * d)

so decompose -> train -> compose repeated is DiLoCo's outer loop. A tensor no path touched is the
base's bytes. Tensors stream one at a time by ranged reads (local or S3): memory stays around one
tensor per input. The output mirrors base/'s files (same tensor order), plus config, tokenizer and
compose.json; its manifest is written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch

from paths.errors import ConfigurationError, IntegrityError, NotFound
from storage.layout import Run
from storage.manifest import ArtifactWriter, read_manifest, read_verified, sha256_hex
from storage.safetensors_io import OutTensor, TensorEntry, header_bytes, read_header

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
NAMES = {v: k for k, v in DTYPES.items()}
Weighting = Literal["uniform", "tokens"]
AHEAD = 2  # tensors merged ahead of the one being written


@dataclass(slots=True)
class Trained:
    """A finished path: its experts per layer, weight in the mean, and its tensors' locations."""

    path: str
    experts: list[int]
    weight: float
    tensors: dict[str, TensorEntry]
    checksum: str
    anchored: bool = False  # trained with --freeze shared: its shared tensors are the base's


def load_tensor(run: Run, entry: TensorEntry) -> torch.Tensor:
    """One tensor by a ranged read."""
    if entry.dtype not in DTYPES:
        raise IntegrityError(f"{run.store.url_of(entry.key)}: tensor {entry.name} has unsupported dtype {entry.dtype}")
    from storage.store import LocalStore

    if entry.begin == entry.end:
        return torch.zeros(entry.shape, dtype=DTYPES[entry.dtype])
    if isinstance(run.store, LocalStore):  # a read-only map of the file: no copy at all
        import numpy as np

        raw = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}[entry.dtype]
        mapped = np.memmap(run.store.path(entry.key), dtype=raw, mode="r", offset=entry.begin, shape=tuple(entry.shape))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(mapped)
        return t.view(torch.bfloat16) if entry.dtype == "BF16" else t
    data = run.store.read_range(entry.key, entry.begin, entry.end)
    with warnings.catch_warnings():  # read-only view of the bytes: nothing writes to it, no copy
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=DTYPES[entry.dtype]).reshape(entry.shape)


def finished_paths(run: Run) -> list[str]:
    """Paths with a committed work/<path>/final/."""
    from paths.decompose import decomposed_paths

    _, ids = decomposed_paths(run)
    return [p for p in ids if run.store.exists(f"{run.final(p)}/manifest.json")]


def _trained(run: Run, pid: str, base_checksum: str, weighting: Weighting) -> Trained:
    prefix = run.final(pid)
    try:
        manifest = read_manifest(run.store, prefix)
    except NotFound:
        raise ConfigurationError(f"path {pid} is not finished (no {run.store.url_of(prefix)}/manifest.json): train it, or leave it out of --paths") from None
    info = json.loads(read_verified(run.store, prefix, "path.json"))
    if info["base_checksum"] != base_checksum:
        raise IntegrityError(f"path {pid} was trained from another base (checksum {info['base_checksum'][:12]}, this run's is {base_checksum[:12]}): leave it out or compose in its own run")
    provenance = json.loads(read_verified(run.store, prefix, "provenance.json"))
    tensors, _, _ = read_header(run.store, f"{prefix}/model.safetensors")
    weight = float(provenance.get("tokens", 0)) if weighting == "tokens" else 1.0
    if weighting == "tokens" and weight <= 0:
        raise ConfigurationError(f"path {pid} records no trained tokens: use --weighting uniform")
    return Trained(pid, info["experts"], weight, tensors, sha256_hex(json.dumps(manifest["files"], sort_keys=True).encode()), bool(provenance.get("anchored")))


def _sources(family, name: str, trained: list[Trained]) -> list[tuple[Trained, str, slice | None]]:
    """(path, its tensor name, slice of the base tensor or None) for each path containing `name`."""
    role = family.classify(name)
    if role.kind == "router":
        return []
    if role.kind == "shared":  # anchored paths left them bitwise the base's: nothing to average
        return [(t, name, None) for t in trained if not t.anchored]
    if role.kind == "expert":
        return [(t, family.dense_mlp(role.layer, role.part), None) for t in trained if t.experts[role.layer] == role.expert]
    raise AssertionError("fused tensors are handled per expert slice")


def _check_shape(run: Run, t: Trained, dense: str, shape: tuple[int, ...]) -> TensorEntry:
    entry = t.tensors.get(dense)
    if entry is None:
        raise IntegrityError(f"path {t.path}'s final/ has no tensor {dense}: it does not match this run's family")
    if tuple(entry.shape) != tuple(shape):
        raise IntegrityError(f"path {t.path}: tensor {dense} has shape {list(entry.shape)}, the base's is {list(shape)}: it was trained from another model")
    return entry


def merged(run: Run, family, base: TensorEntry, trained: list[Trained], outer_lr: float, momentum: float, m_prev: torch.Tensor | None, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, list[str]]:
    """(new tensor, new momentum or None, contributing paths) of one base tensor. With outer_lr 1
    and no momentum, a tensor (or expert slice) that one path fed is that path's value, exactly."""
    role = family.classify(base.name)
    base_t = load_tensor(run, base)
    plain = outer_lr == 1.0 and momentum == 0
    if role.kind == "fused":  # [E, ...]: each expert slice from the paths choosing it
        delta = torch.zeros(base_t.shape, dtype=torch.float32)
        copied: dict[int, torch.Tensor] = {}
        used: set[str] = set()
        for e in range(base_t.shape[0]):
            sources = _fused_sources(family, role, e, trained, base_t[e].shape, run)
            if plain and len(sources) == 1:
                copied[e] = _value(run, sources[0][1])
                used.add(sources[0][0].path)
                continue
            d, names = _mean_delta(run, family, base_t[e].float(), sources)
            if d is not None:
                delta[e] = d
                used.update(names)
        touched = sorted(used)
        if not touched:
            return base_t, None, []
        if plain:
            new = (base_t.float() + delta).to(out_dtype)
            for e, value in copied.items():
                new[e] = value.to(out_dtype)
            return new, None, touched
    else:
        sources = [(t, _check_shape(run, t, n, base_t.shape), s) for t, n, s in _sources(family, base.name, trained)]
        if plain and len(sources) == 1:
            return _value(run, sources[0][1]).to(out_dtype), None, [sources[0][0].path]
        delta, touched = _mean_delta(run, family, base_t.float(), sources)
    if not touched:
        return base_t, None, []
    m = delta if m_prev is None else momentum * m_prev + delta
    update = delta + momentum * m if momentum > 0 else delta
    return (base_t.float() + outer_lr * update).to(out_dtype), (m if momentum > 0 else None), touched


def _value(run: Run, entry) -> torch.Tensor:
    """A path's tensor (gate and up rows concatenated for a fused gate_up slice)."""
    return torch.cat([load_tensor(run, x) for x in entry]) if isinstance(entry, tuple) else load_tensor(run, entry)


def _fused_sources(family, role, e: int, trained: list[Trained], shape, run: Run):
    out = []
    for t in trained:
        if t.experts[role.layer] != e:
            continue
        if role.part == "gate_up":  # [2I, H] = gate rows then up rows
            gate = _check_shape(run, t, family.dense_mlp(role.layer, "gate"), (shape[0] // 2, shape[1]))
            up = _check_shape(run, t, family.dense_mlp(role.layer, "up"), (shape[0] // 2, shape[1]))
            out.append((t, (gate, up), None))
        else:
            out.append((t, _check_shape(run, t, family.dense_mlp(role.layer, "down"), tuple(shape)), None))
    return out


def _mean_delta(run: Run, family, base_f: torch.Tensor, sources) -> tuple[torch.Tensor | None, list[str]]:
    """Weighted mean of (path tensor - base) in float32, reading one path tensor at a time."""
    if not sources:
        return None, []
    total, weight = None, 0.0
    for t, entry, _ in sources:
        delta = torch.sub(_value(run, entry).float(), base_f)
        if t.weight != 1.0:
            delta.mul_(t.weight)
        total = delta if total is None else total.add_(delta)
        weight += t.weight
    return total.div_(weight), [t.path for t, _, _ in sources]


@dataclass(slots=True)
class OptOut:
    """Experts left out of a composed model: removed[l] are layer l's expert ids that were trained
    only by excluded paths; keep[l] the old ids that stay, in order (new id = position)."""

    excluded: list[str]
    removed: list[list[int]]
    keep: list[list[int]]

    @property
    def active(self) -> bool:
        return any(self.removed)

    def new_index(self, layer: int) -> dict[int, int]:
        return {old: new for new, old in enumerate(self.keep[layer])}


def opt_out(plan, trained_ids: list[str], excluded: list[str], top_k: int) -> OptOut:
    """Which experts to remove so that no excluded path's expert can be selected; an expert an
    included path also trained stays (with only the included paths' deltas)."""
    E = plan.num_experts
    removed = []
    for layer in range(plan.num_layers):
        theirs = {plan.experts_per_layer(p)[layer] for p in excluded}
        ours = {plan.experts_per_layer(p)[layer] for p in trained_ids}
        removed.append(sorted(theirs - ours))
    counts = {len(r) for r in removed}
    if len(counts) > 1:
        raise ConfigurationError(
            f"excluding {','.join(excluded)} would remove {[len(r) for r in removed]} experts per layer; a checkpoint needs one count "
            "for every layer: exclude paths whose experts line up (a one-level plan: one domain expert per path), or fewer")
    left = E - counts.pop()
    if left < max(1, top_k):
        raise ConfigurationError(f"excluding {','.join(excluded)} leaves {left} experts per layer, fewer than the {top_k} each token uses: exclude fewer")
    return OptOut(excluded, removed, [[e for e in range(E) if e not in r] for r in removed])


def _selection(run: Run, plan, paths: list[str] | None, include: list[str] | None, exclude: list[str] | None) -> tuple[list[str], list[str]]:
    """(paths to compose, paths opted out)."""
    if include is not None and (paths or exclude):
        raise ConfigurationError("--include names the paths to keep; it does not go with --paths or --exclude")
    for pid in [*(include or []), *(exclude or [])]:
        plan.parse(pid)  # a clear error for a malformed or out-of-plan id
    finished = finished_paths(run)
    if include is not None:
        if not include:
            raise ConfigurationError("--include is empty: name at least one path to keep")
        return list(include), [p for p in finished if p not in include]
    excluded = list(exclude or [])
    chosen = [p for p in (paths if paths else finished) if p not in excluded]
    return chosen, excluded


def compose_moe(
    run: Run,
    name: str,
    *,
    paths: list[str] | None = None,
    outer_lr: float = 1.0,
    momentum: float = 0.0,
    weighting: Weighting = "uniform",
    previous: str | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    router: Literal["keep", "centroid", "domain-embed"] = "keep",
    router_data: str | None = None,
    router_docs: int = 64,
    exclude: list[str] | None = None,
    include: list[str] | None = None,
) -> dict[str, Any]:
    """Write composed/<name>/ (HF MoE checkpoint + compose.json); returns compose.json.
    `router="centroid"` re-initialises the routers from `router_data` (a documents dataset) through
    the composed model; `"domain-embed"` from each path's own trained model on a sample of its
    documents (FlexOlmo). `exclude` / `include`: opt-out, the excluded paths' experts are removed."""
    from safetensors.torch import load as st_load, save as st_save

    from paths.base import require_base
    from paths.decompose import run_plan

    meta = require_base(run)
    plan, family, base_cfg = run_plan(run)
    prefix = run.composed(name)
    if run.store.exists(f"{prefix}/manifest.json"):
        if not overwrite:
            raise ConfigurationError(f"{run.store.url_of(prefix)} already exists: pass --overwrite or choose another --name")
    if router not in ("keep", "centroid", "domain-embed"):
        raise ConfigurationError(f"--router must be keep, centroid or domain-embed, got {router!r}")
    if router != "keep" and not router_data:
        raise ConfigurationError(f"--router {router} needs --router-data DATASET (the documents the paths were trained on)")
    if not 0 <= momentum < 1 or outer_lr <= 0:
        raise ConfigurationError(f"--momentum must be in [0, 1) and --outer-lr > 0, got {momentum} and {outer_lr}")
    ids, excluded = _selection(run, plan, paths, include, exclude)
    if not ids:
        raise ConfigurationError(f"no finished path to compose in {run.url}: train some (`paths claim && paths train`) or name them with --paths")
    out_out = opt_out(plan, ids, excluded, int(base_cfg.get(family.top_k_field, 1)))
    if out_out.active and (momentum > 0 or previous):
        raise ConfigurationError("--exclude/--include with --momentum or --previous: an opt-out build is for inference; compose it without momentum")
    trained = [_trained(run, pid, meta["base"]["checksum"], weighting) for pid in ids]
    m_prev: dict[str, torch.Tensor] = {}
    if previous:
        m_prev = st_load(read_verified(run.store, run.composed(previous), "momentum.safetensors")) if momentum > 0 else {}
    out_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype) if dtype else None
    if dtype and out_dtype is None:
        raise ConfigurationError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    t0 = time.perf_counter()
    rows, routed = None, None
    if router == "domain-embed":  # from the trained paths alone: computed before anything is written
        from compose.router_init import base_router_rows, domain_embed_rows

        rows, routed = domain_embed_rows(run, family, plan, ids, router_data, base_router_rows(run, family, plan), max_docs=router_docs)
    if overwrite:
        run.store.delete_prefix(prefix)
    base_files = read_manifest(run.store, run.base)["files"]
    tmp = _scratch(run)
    fed: dict[str, list[str]] = {}
    hashes: dict[str, str] = {}
    new_momentum: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    try:
        for fname in base_files:
            if not fname.endswith(".safetensors"):
                continue
            entries, metadata, _ = read_header(run.store, f"{run.base}/{fname}")
            order, out_tensors = [], []
            for e in sorted(entries.values(), key=lambda e: e.begin):
                out = _out_tensor(family, e, out_out, out_dtype)
                if out is not None:
                    order.append(e)
                    out_tensors.append(out)
                    weight_map[out.name] = fname

            def compute(entry: TensorEntry):
                target = out_dtype or DTYPES[entry.dtype]
                new, m, used = merged(run, family, entry, trained, outer_lr, momentum, m_prev.get(entry.name), target)
                if used:
                    fed[entry.name] = used
                    if m is not None:
                        new_momentum[entry.name] = m.contiguous()
                role = family.classify(entry.name)
                if role.kind == "router" and rows is not None:
                    new = rows[role.layer]
                if role.kind in ("router", "fused") and out_out.active:
                    new = new[out_out.keep[role.layer]]
                return new.to(target).contiguous().view(torch.uint8).numpy() if new.numel() else b""  # buffer, not a copy

            digest = hashlib.sha256()
            with open(os.path.join(tmp, fname), "wb") as f, ThreadPoolExecutor(AHEAD) as pool, ThreadPoolExecutor(1) as hasher:
                header = header_bytes(out_tensors, metadata)
                f.write(header)
                digest.update(header)
                # The next tensors are merged while this one is hashed and written, each in its own
                # thread (torch, hashing and file writes release the GIL); memory stays ~ AHEAD + 1
                # tensors per input.
                pending = deque(pool.submit(compute, e) for e in order[:AHEAD])
                flushed = 0
                for i in range(len(order)):
                    data = pending.popleft().result()
                    if i + AHEAD < len(order):
                        pending.append(pool.submit(compute, order[i + AHEAD]))
                    hashed = hasher.submit(digest.update, data)
                    f.write(data)
                    hashed.result()
                    flushed = _start_writeback(f, flushed, hasher)
            hashes[fname] = digest.hexdigest()
        if out_dtype is not None and any(f.endswith(".index.json") for f in base_files):
            raise ConfigurationError("--dtype with a sharded base is not supported yet: compose in the base's dtype")
        weight_files = [f for f in base_files if f.endswith(".safetensors")]
        extra = _config_files(run, base_files, family, out_out, out_dtype, dtype, weight_map)
        if router == "centroid":
            from compose.router_init import apply_centroids

            for fname in base_files:
                if not fname.endswith(".safetensors"):
                    with open(os.path.join(tmp, fname), "wb") as f:
                        f.write(extra.get(fname) or read_verified(run.store, run.base, fname))
            routed = apply_centroids(run, tmp, family, plan, router_data, weight_files, paths=ids, keep=out_out.keep)
            for fname in weight_files:  # the routers changed in place: hash the files again
                digest = hashlib.sha256()
                with open(os.path.join(tmp, fname), "rb") as f:
                    while block := f.read(8 << 20):
                        digest.update(block)
                hashes[fname] = digest.hexdigest()
        writer = ArtifactWriter(run.store, prefix)
        for fname in base_files:
            if fname.endswith(".safetensors"):  # hashed while written: moved in, not read again
                local = os.path.join(tmp, fname)
                writer.files[fname] = {"bytes": os.path.getsize(local), "sha256": hashes[fname]}
                run.store.move_in(f"{prefix}/{fname}", local)
            else:
                writer.write(fname, extra.get(fname) or read_verified(run.store, run.base, fname))
        for fname in read_manifest(run.store, run.tokenizer)["files"]:
            writer.write(fname, read_verified(run.store, run.tokenizer, fname))
        if new_momentum:
            writer.write("momentum.safetensors", st_save(new_momentum))
        everyone = sorted(t.path for t in trained)
        free = [t.path for t in trained if not t.anchored]
        record = {
            "name": name, "into": "moe", "base_checksum": meta["base"]["checksum"], "family": family.name,
            "options": {"outer_lr": outer_lr, "momentum": momentum, "weighting": weighting, "previous": previous, "dtype": dtype, "router": router, "router_data": router_data},
            "router_documents": routed,
            "paths": {t.path: {"final_checksum": t.checksum, "weight": t.weight, "anchored": t.anchored} for t in trained},
            "shared": (f"mean of {len(free)} free paths" + (f"; {len(trained) - len(free)} anchored paths add nothing" if len(free) < len(trained) else "")) if free
            else "the base's: every path was trained anchored (--freeze shared), no averaging",
            "excluded": {"paths": sorted(excluded), "removed_experts": {str(l): r for l, r in enumerate(out_out.removed)}, "experts_kept": {str(l): k for l, k in enumerate(out_out.keep)} if out_out.active else None},
            "tensors": {k: ("all" if v == everyone else v) for k, v in sorted(fed.items())},
            "seconds": round(time.perf_counter() - t0, 3), "at": time.time(),
        }
        writer.write_json("compose.json", record)
        writer.commit(kind="composed", into="moe", name=name)
        return record
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _out_tensor(family, entry: TensorEntry, out: OptOut, out_dtype: torch.dtype | None) -> OutTensor | None:
    """The output tensor a base tensor becomes: None when its expert is removed, renamed when the
    experts after a removed one move down, router and fused tensors with fewer rows."""
    dtype = NAMES[out_dtype] if out_dtype else entry.dtype
    if not out.active:
        return OutTensor(entry.name, dtype, entry.shape, _nbytes(entry, out_dtype))
    role = family.classify(entry.name)
    if role.kind == "expert":
        if role.expert in out.removed[role.layer]:
            return None
        name = family.disk_expert(role.layer, out.new_index(role.layer)[role.expert], role.part)
        return OutTensor(name, dtype, entry.shape, _nbytes(entry, out_dtype))
    if role.kind in ("router", "fused"):
        shape = (len(out.keep[role.layer]), *entry.shape[1:])
        resized = TensorEntry(entry.key, entry.name, entry.dtype, shape, 0, entry.nbytes // entry.shape[0] * shape[0])
        return OutTensor(entry.name, dtype, shape, _nbytes(resized, out_dtype))
    return OutTensor(entry.name, dtype, entry.shape, _nbytes(entry, out_dtype))


def _config_files(run: Run, base_files, family, out: OptOut, out_dtype, dtype: str | None, weight_map: dict[str, str]) -> dict[str, bytes]:
    """config.json (dtype, expert count) and the shard index, where they change."""
    changed: dict[str, bytes] = {}
    if out_dtype is not None or out.active:
        config = json.loads(read_verified(run.store, run.base, "config.json"))
        if out_dtype is not None:
            config.update(dtype=dtype, torch_dtype=dtype)
        if out.active:
            for key in (family.num_experts_field, *family.num_experts_aliases):
                if key in config:
                    config[key] = len(out.keep[0])
        changed["config.json"] = json.dumps(config, indent=2).encode()
    for fname in base_files:
        if fname.endswith(".index.json") and out.active:
            index = json.loads(read_verified(run.store, run.base, fname))
            index["weight_map"] = dict(sorted(weight_map.items()))
            changed[fname] = json.dumps(index, indent=2).encode()
    return changed


WRITEBACK = 64 << 20


def _start_writeback(f, flushed: int, pool: ThreadPoolExecutor) -> int:
    """Every 64 MiB written, have a background thread ask the kernel to write those pages to disk
    now, so the fsync before the file is moved into place finds little left (writing overlaps
    merging); the pages leave the cache, which nothing reads again."""
    end = f.tell()
    if end - flushed < WRITEBACK or not hasattr(os, "posix_fadvise"):
        return flushed
    f.flush()
    pool.submit(os.posix_fadvise, f.fileno(), flushed, end - flushed, os.POSIX_FADV_DONTNEED)  # Linux: starts writeback
    return end


def _scratch(run: Run) -> str:
    """A temp folder; on a local run, inside it (hidden), so finished files are renamed into place."""
    from storage.store import HIDDEN_PREFIX, LocalStore

    if isinstance(run.store, LocalStore):
        return tempfile.mkdtemp(prefix=f"{HIDDEN_PREFIX}compose-", dir=run.store.root)
    return tempfile.mkdtemp(prefix="paths-compose-")


def _nbytes(entry: TensorEntry, out_dtype: torch.dtype | None) -> int:
    if out_dtype is None:
        return entry.nbytes
    n = 1
    for s in entry.shape:
        n *= s
    return n * torch.tensor([], dtype=out_dtype).element_size()
