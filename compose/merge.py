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
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import torch

from compose.plan import ComposePlan, OptOut, Sources, plan_compose
from paths.models import DTYPES, load_tensor
from storage.layout import Run
from storage.manifest import install, read_manifest, read_verified
from storage.safetensors_io import TensorEntry, header_bytes

if TYPE_CHECKING:
    from paths.families import Family

AHEAD = 2  # tensors merged ahead of the one being written


def merged(run: Run, family: Family, base: TensorEntry, sources: Sources | dict[int, Sources], outer_lr: float, momentum: float, m_prev: torch.Tensor | None, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, list[str]]:
    """(new tensor, new momentum or None, contributing paths) of one base tensor from its planned
    sources (`compose.plan.tensor_sources`). With outer_lr 1 and no momentum, a tensor (or expert
    slice) that one path contributed is that path's value, exactly."""
    role = family.classify(base.name)
    base_t = load_tensor(run, base)
    plain = outer_lr == 1.0 and momentum == 0
    idle: list[int] = []  # expert slices of a fused tensor that no path fed
    if role.kind == "fused":  # [E, ...]: each expert slice from the paths choosing it
        delta = torch.zeros(base_t.shape, dtype=torch.float32)
        copied: dict[int, torch.Tensor] = {}
        used: set[str] = set()
        for e in range(base_t.shape[0]):
            here = sources[e]
            if plain and len(here) == 1:
                copied[e] = _value(run, here[0][1])
                used.add(here[0][0].path)
                continue
            d, names = _mean_delta(run, base_t[e].float(), here)
            if d is not None:
                delta[e] = d
                used.update(names)
            else:
                idle.append(e)
        touched = sorted(used)
        if not touched:
            return base_t, (m_prev if momentum > 0 else None), []
        if plain:
            new = (base_t.float() + delta).to(out_dtype)
            for e, value in copied.items():
                new[e] = value.to(out_dtype)
            return new, None, touched
    else:
        if plain and len(sources) == 1:
            return _value(run, sources[0][1]).to(out_dtype), None, [sources[0][0].path]
        delta, touched = _mean_delta(run, base_t.float(), sources)
    if not touched:  # nobody fed it (a path dropped from DiLoCo rounds): its value, and its momentum for when one does
        return base_t, (m_prev if momentum > 0 else None), []
    m = delta if m_prev is None else momentum * m_prev + delta
    update = delta + momentum * m if momentum > 0 else delta
    new = base_t.float() + outer_lr * update
    if idle:  # expert slices nobody fed: as they were, value and momentum (not moved by the momentum alone)
        new[idle] = base_t[idle].float()
        if momentum > 0:
            m[idle] = m_prev[idle] if m_prev is not None else 0.0
    return new.to(out_dtype), (m if momentum > 0 else None), touched


def _value(run: Run, entry: TensorEntry) -> torch.Tensor:
    """A path's tensor (gate and up rows concatenated for a fused gate_up slice)."""
    return torch.cat([load_tensor(run, x) for x in entry]) if isinstance(entry, tuple) else load_tensor(run, entry)


def _mean_delta(run: Run, base_f: torch.Tensor, sources: Sources) -> tuple[torch.Tensor | None, list[str]]:
    """Weighted mean of (path tensor - base) in float32, reading one path tensor at a time."""
    if not sources:
        return None, []
    total, weight = None, 0.0
    for t, entry in sources:
        delta = torch.sub(_value(run, entry).float(), base_f)
        if t.weight != 1.0:
            delta.mul_(t.weight)
        total = delta if total is None else total.add_(delta)
        weight += t.weight
    return total.div_(weight), [t.path for t, _ in sources]


def compose_moe(run: Run, name: str, **options: Any) -> dict[str, Any]:
    """Write composed/<name>/ (HF MoE checkpoint + compose.json); returns compose.json. The options
    are `compose.plan.plan_compose`'s: paths, outer_lr, momentum, weighting, previous, dtype,
    overwrite; `router="centroid"` re-initialises the routers from `router_data` (a documents
    dataset) through the composed model, `"domain-embed"` from each path's own trained model on a
    sample of its documents (FlexOlmo); `exclude` / `include`: opt-out, the excluded paths' experts
    are removed. Plans first (every check), then `execute`s the plan."""
    return execute(run, plan_compose(run, name, **options))


def execute(run: Run, plan: ComposePlan, fence: Callable[[], None] | None = None, tensor_hashes: bool = False) -> dict[str, Any]:
    """Stream a planned compose into a scratch folder, then install it as composed/<name>/: an
    existing one is replaced only once the new one is complete and committed (storage.manifest.install).
    `fence` runs right before the install (raises to refuse it); `tensor_hashes`: the manifest
    also holds every tensor's sha256, as base/'s does, so paths can be cut from it (DiLoCo rounds)."""
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    family, grid, dropped, out_dtype = plan.family, plan.plan, plan.dropped, plan.out_dtype
    m_prev: dict[str, torch.Tensor] = {}
    if plan.previous and plan.momentum > 0:
        m_prev = st_load(read_verified(run.store, run.composed(plan.previous), "momentum.safetensors"))
    t0 = time.perf_counter()
    rows, routed = None, None
    if plan.router == "domain-embed":  # from the trained paths alone
        from compose.router_init import base_router_rows, domain_embed_rows

        rows, routed = domain_embed_rows(run, family, grid, plan.ids, plan.router_data, base_router_rows(run, family, grid), max_docs=plan.router_docs)
    tmp = run.store.scratch_dir("compose")
    contributors: dict[str, list[str]] = {}
    hashed: dict[str, dict[str, Any]] = {}
    new_momentum: dict[str, torch.Tensor] = {}
    try:
        for out in plan.files:

            def compute(entry: TensorEntry):
                target = out_dtype or DTYPES[entry.dtype]
                new, m, used = merged(run, family, entry, plan.sources[entry.name], plan.outer_lr, plan.momentum, m_prev.get(entry.name), target)
                if used:
                    contributors[entry.name] = used
                if m is not None:  # a tensor nobody fed keeps the momentum it had
                    new_momentum[entry.name] = m.contiguous()
                role = family.classify(entry.name)
                if role.kind == "router" and rows is not None:  # new rows: the extras fitted to the old ones (a bias) start at zero
                    new = rows[role.layer] if role.part != "extra" else torch.zeros_like(new)
                if role.kind in ("router", "fused") and dropped.active:
                    new = new[dropped.keep[role.layer]]
                return new.to(target).contiguous().view(torch.uint8).numpy() if new.numel() else b""  # buffer, not a copy

            order = out.inputs
            digest = hashlib.sha256()
            with open(os.path.join(tmp, out.name), "wb") as f, ThreadPoolExecutor(AHEAD) as pool, ThreadPoolExecutor(1) as hasher:
                header = header_bytes(out.outputs, out.metadata)
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
                    hashing = hasher.submit(digest.update, data)
                    f.write(data)
                    hashing.result()
                    flushed = _start_writeback(f, flushed, hasher)
                size = f.tell()
            hashed[out.name] = {"bytes": size, "sha256": digest.hexdigest()}
        weight_files = [f.name for f in plan.files]
        extra = _config_files(run, plan.base, plan.base_files, family, dropped, out_dtype, plan.dtype, plan.weight_map)
        for fname in plan.base_files:
            if not fname.endswith(".safetensors"):
                with open(os.path.join(tmp, fname), "wb") as f:
                    f.write(extra.get(fname) or read_verified(run.store, plan.base, fname))
        if plan.router == "centroid":
            from compose.router_init import apply_centroids

            routed = apply_centroids(run, tmp, family, grid, plan.router_data, weight_files, paths=plan.ids, keep=dropped.keep)
            hashed.clear()  # the routers changed in place: install hashes the files again
        for fname in read_manifest(run.store, run.tokenizer)["files"]:
            with open(os.path.join(tmp, fname), "wb") as f:
                f.write(read_verified(run.store, run.tokenizer, fname))
        if new_momentum:
            with open(os.path.join(tmp, "momentum.safetensors"), "wb") as f:
                f.write(st_save(new_momentum))
        record = _record(plan, routed, contributors, time.perf_counter() - t0)
        tensors = {}
        if tensor_hashes:
            from paths.prepare.init import hash_tensors

            tensors["tensors"] = hash_tensors(tmp, family, plan.plan.num_experts)
        if fence is not None:
            fence()
        install(run.store, tmp, plan.prefix, plan.overwrite, {"compose.json": record}, hashed, kind="composed", into="moe", name=plan.name, **tensors)
        return record
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _record(plan: ComposePlan, routed: Any, contributors: dict[str, list[str]], seconds: float) -> dict[str, Any]:
    """compose.json: options, inputs with their checksums, opt-out, and which paths fed each tensor."""
    trained = plan.trained
    everyone = sorted(t.path for t in trained)
    averaged = [t.path for t in trained if not t.anchored]  # anchored paths left the shared tensors the base's
    return {
        "name": plan.name, "into": "moe", "base_checksum": plan.base_checksum, "family": plan.family.name, "start": plan.base,
        "options": {"outer_lr": plan.outer_lr, "momentum": plan.momentum, "weighting": plan.weighting, "previous": plan.previous, "dtype": plan.dtype,
                    "router": plan.router, "router_data": plan.router_data},
        "router_documents": routed,
        "paths": {t.path: {"final_checksum": t.checksum, "weight": t.weight, "anchored": t.anchored} for t in trained},
        "shared": (f"mean of {len(averaged)} free paths" + (f"; {len(trained) - len(averaged)} anchored paths add nothing" if len(averaged) < len(trained) else "")) if averaged
        else "the base's: every path was trained anchored (--freeze shared), no averaging",
        "excluded": {"paths": sorted(plan.excluded), "removed_experts": {str(l): r for l, r in enumerate(plan.dropped.removed)},
                     "experts_kept": {str(l): k for l, k in enumerate(plan.dropped.keep)} if plan.dropped.active else None},
        "tensors": {k: ("all" if v == everyone else v) for k, v in sorted(contributors.items())},
        "seconds": round(seconds, 3), "at": time.time(),
    }


def _config_files(run: Run, base: str, base_files: list[str], family: Family, out: OptOut, out_dtype: torch.dtype | None, dtype: str | None, weight_map: dict[str, str]) -> dict[str, bytes]:
    """config.json (dtype, expert count) and the shard index, where they change."""
    changed: dict[str, bytes] = {}
    if out_dtype is not None or out.active:
        config = json.loads(read_verified(run.store, base, "config.json"))
        if out_dtype is not None:
            config.update(dtype=dtype, torch_dtype=dtype)
        if out.active:
            for key in (family.num_experts_field, *family.num_experts_aliases):
                if key in config:
                    config[key] = len(out.keep[0])
        changed["config.json"] = json.dumps(config, indent=2).encode()
    for fname in base_files:
        if fname.endswith(".index.json") and out.active:
            index = json.loads(read_verified(run.store, base, fname))
            index["weight_map"] = dict(sorted(weight_map.items()))
            changed[fname] = json.dumps(index, indent=2).encode()
    return changed


WRITEBACK = 64 << 20


def _start_writeback(f: Any, flushed: int, pool: ThreadPoolExecutor) -> int:
    """Every 64 MiB written, have a background thread ask the kernel to write those pages to disk
    now, so the fsync before the file is moved into place finds little left (writing overlaps
    merging); the pages leave the cache, which nothing reads again."""
    end = f.tell()
    if end - flushed < WRITEBACK or not hasattr(os, "posix_fadvise"):
        return flushed
    f.flush()
    pool.submit(os.posix_fadvise, f.fileno(), flushed, end - flushed, os.POSIX_FADV_DONTNEED)  # Linux: starts writeback
    return end
