"""The plan of a `paths compose --into moe`: which tensors come from which paths, what is opted out,
the output dtype, router and files, decided and validated before anything is written.

`plan_compose` reads only manifests, JSON records and safetensors headers; every check that can
fail (options, the selection, each path's final/ against its manifest and the base's shapes, opt-out
counts, dtype with a sharded base) fails here. `paths compose --dry-run` prints `ComposePlan.describe`;
`compose.merge.execute` then only streams.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch

from paths.errors import ConfigurationError, IntegrityError, NotFound
from paths.families import fill
from paths.models import DTYPES
from paths.units import finished_paths
from storage.layout import Run
from storage.manifest import read_manifest, read_verified, sha256_hex
from storage.safetensors_io import OutTensor, TensorEntry, read_header

if TYPE_CHECKING:
    from paths.families import Family
    from paths.plan import Plan

NAMES = {v: k for k, v in DTYPES.items()}
Weighting = Literal["uniform", "tokens"]
Router = Literal["keep", "centroid", "domain-embed"]


@dataclass(slots=True)
class Trained:
    """A finished path: its experts per layer, weight in the mean, and its tensors' locations."""

    path: str
    experts: list[int]
    weight: float
    tensors: dict[str, TensorEntry]
    checksum: str
    anchored: bool = False  # trained with --freeze shared: its shared tensors are the base's


def trained_path(run: Run, pid: str, base_checksum: str, weighting: Weighting, prefix: str | None = None) -> Trained:
    """A finished path's work/<path>/final/ (or another artifact of its weights, `prefix`: a
    DiLoCo round's diloco/r<r>/<path>/), checked against its manifest and the run's base."""
    prefix = prefix or run.final(pid)
    try:
        manifest = read_manifest(run.store, prefix)
    except NotFound:
        raise ConfigurationError(f"path {pid} is not finished (no {run.store.url_of(prefix)}/manifest.json): train it, or leave it out of --paths") from None
    for fname, entry in manifest["files"].items():  # a truncated or missing file fails here, not midway
        key = f"{prefix}/{fname}"
        size = run.store.size(key) if run.store.exists(key) else None
        if size != entry["bytes"]:
            raise IntegrityError(f"path {pid}: {run.store.url_of(key)} has {size if size is not None else 'no'} bytes, its manifest says {entry['bytes']}: restore it, or retrain the path")
    info = json.loads(read_verified(run.store, prefix, "path.json"))
    if info["base_checksum"] != base_checksum:
        raise IntegrityError(f"path {pid} was trained from another base (checksum {info['base_checksum'][:12]}, this run's is {base_checksum[:12]}): leave it out or compose in its own run")
    provenance = json.loads(read_verified(run.store, prefix, "provenance.json"))
    tensors, _, _ = read_header(run.store, f"{prefix}/model.safetensors")
    weight = float(provenance.get("tokens", 0)) if weighting == "tokens" else 1.0
    if weighting == "tokens" and weight <= 0:
        raise ConfigurationError(f"path {pid} records no trained tokens: use --weighting uniform")
    return Trained(pid, info["experts"], weight, tensors, sha256_hex(json.dumps(manifest["files"], sort_keys=True).encode()), bool(provenance.get("anchored")))


def _sources(family: Family, name: str, trained: list[Trained]) -> list[tuple[Trained, str]]:
    """(path, its tensor name) for each path containing base tensor `name`."""
    role = family.classify(name)
    if role.kind == "router":
        return []
    if role.kind == "shared":  # anchored paths left them bitwise the base's: nothing to average
        return [(t, name) for t in trained if not t.anchored]
    if role.kind == "expert":
        return [(t, family.dense_mlp(role.layer, role.part)) for t in trained if t.experts[role.layer] == role.expert]
    raise AssertionError("fused tensors are handled per expert slice")


def _check_shape(run: Run, t: Trained, dense: str, shape: tuple[int, ...]) -> TensorEntry:
    entry = t.tensors.get(dense)
    if entry is None:
        raise IntegrityError(f"path {t.path}'s final/ has no tensor {dense}: it does not match this run's family")
    if tuple(entry.shape) != tuple(shape):
        raise IntegrityError(f"path {t.path}: tensor {dense} has shape {list(entry.shape)}, the base's is {list(shape)}: it was trained from another model")
    return entry


def _fused_sources(family: Family, role: Any, e: int, trained: list[Trained], shape: tuple[int, ...], run: Run):
    out = []
    for t in trained:
        if t.experts[role.layer] != e:
            continue
        name = fill(family.experts_memory[role.part], role.layer)
        if not family.has_dense_sibling and name in t.tensors:  # a "moe" path keeps the fused tensor, one expert in it
            entry = _check_shape(run, t, name, (1, *shape))
            out.append((t, TensorEntry(entry.key, entry.name, entry.dtype, tuple(shape), entry.begin, entry.end)))
        elif role.part == "gate_up":  # [2I, H] = gate rows then up rows
            gate = _check_shape(run, t, family.dense_mlp(role.layer, "gate"), (shape[0] // 2, shape[1]))
            up = _check_shape(run, t, family.dense_mlp(role.layer, "up"), (shape[0] // 2, shape[1]))
            out.append((t, (gate, up)))
        else:
            out.append((t, _check_shape(run, t, family.dense_mlp(role.layer, "down"), tuple(shape))))
    return out


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


def opt_out(plan: Plan, trained_ids: list[str], excluded: list[str], top_k: int, groups: int = 1) -> OptOut:
    """Which experts to remove so that no excluded path's expert can be selected; an expert an
    included path also trained stays (with only the included paths' deltas)."""
    E = plan.num_experts
    removed: list[list[int]] = [[] for _ in range(plan.num_layers)]  # per layer (a dense layer has none)
    for layer in plan.sparse_layers:
        theirs = {plan.experts_per_layer(p)[layer] for p in excluded}
        ours = {plan.experts_per_layer(p)[layer] for p in trained_ids}
        removed[layer] = sorted(theirs - ours)
    counts = {len(removed[layer]) for layer in plan.sparse_layers}
    if len(counts) > 1:
        raise ConfigurationError(
            f"excluding {','.join(excluded)} would remove {[len(r) for r in removed]} experts per layer; a checkpoint needs one count "
            "for every layer: exclude paths whose experts line up (a one-level plan: one domain expert per path), or fewer")
    left = E - counts.pop()
    if left < max(1, top_k):
        raise ConfigurationError(f"excluding {','.join(excluded)} leaves {left} experts per layer, fewer than the {top_k} each token uses: exclude fewer")
    if groups > 1 and (left % groups or left // groups < 2):
        raise ConfigurationError(f"excluding {','.join(excluded)} leaves {left} experts per layer, which the router's {groups} groups (n_group) cannot split into "
                                 f"groups of 2 or more: exclude paths whose experts leave whole groups, or compose without --exclude")
    return OptOut(excluded, removed, [[e for e in range(E) if e not in r] for r in removed])


def selection(run: Run, plan: Plan, paths: list[str] | None, include: list[str] | None, exclude: list[str] | None) -> tuple[list[str], list[str]]:
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


def out_tensor(family: Family, entry: TensorEntry, out: OptOut, out_dtype: torch.dtype | None) -> OutTensor | None:
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


def _nbytes(entry: TensorEntry, out_dtype: torch.dtype | None) -> int:
    if out_dtype is None:
        return entry.nbytes
    n = 1
    for s in entry.shape:
        n *= s
    return n * torch.tensor([], dtype=out_dtype).element_size()


Sources = list[tuple[Trained, Any]]  # (path, its tensor entry, or (gate, up) entries of a fused slice)


def tensor_sources(run: Run, family: Family, entry: TensorEntry, trained: list[Trained]) -> Sources | dict[int, Sources]:
    """Where a base tensor's new value comes from: the paths containing it (shapes checked), or
    for a fused [E, ...] tensor, the paths of each expert slice."""
    role = family.classify(entry.name)
    if role.kind == "fused":
        return {e: _fused_sources(family, role, e, trained, entry.shape[1:], run) for e in range(entry.shape[0])}
    return [(t, _check_shape(run, t, n, entry.shape)) for t, n in _sources(family, entry.name, trained)]


@dataclass(slots=True)
class OutputFile:
    """One weight file of the output: the base tensors it is made of, in file order, and what each becomes."""

    name: str
    metadata: dict[str, str] | None
    inputs: list[TensorEntry]
    outputs: list[OutTensor]


@dataclass(slots=True)
class ComposePlan:
    """Everything `execute` needs, decided: nothing in it is computed again while writing."""

    name: str
    prefix: str
    overwrite: bool
    replaces: bool  # an older composed/<name>/ exists (kept whole until the new one is complete)
    family: Family
    plan: Plan
    base_checksum: str
    ids: list[str]
    excluded: list[str]
    dropped: OptOut
    trained: list[Trained]
    outer_lr: float
    momentum: float
    weighting: Weighting
    previous: str | None
    dtype: str | None
    out_dtype: torch.dtype | None
    router: Router
    router_data: str | None
    router_docs: int
    base_files: list[str]
    files: list[OutputFile]
    weight_map: dict[str, str]
    sources: dict[str, Any] = field(default_factory=dict)
    base: str = "base"  # the checkpoint the deltas are taken from (a DiLoCo round's start)

    def describe(self, run: Run) -> dict[str, Any]:
        """What `paths compose --dry-run` prints: the output, the inputs, and where each tensor comes from."""
        from_paths = sum(1 for v in self.sources.values() if (any(v.values()) if isinstance(v, dict) else v))
        total = sum(len(f.inputs) for f in self.files)
        return {
            "output": run.store.url_of(self.prefix), "replaces_existing": self.replaces, "into": "moe",
            "paths": self.ids, "excluded": self.excluded, "removed_experts": {str(l): r for l, r in enumerate(self.dropped.removed)} if self.dropped.active else {},
            "options": {"outer_lr": self.outer_lr, "momentum": self.momentum, "weighting": self.weighting, "previous": self.previous,
                        "dtype": self.dtype or "the base's", "router": self.router, "router_data": self.router_data},
            "tensors": {"total": total, "merged": from_paths, "unchanged": total - from_paths},
            "files": {f.name: {"tensors": len(f.outputs), "bytes": sum(o.nbytes for o in f.outputs)} for f in self.files},
        }


def plan_compose(
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
    router: Router = "keep",
    router_data: str | None = None,
    router_docs: int = 64,
    exclude: list[str] | None = None,
    include: list[str] | None = None,
    base: str | None = None,
    weights: Callable[[str], str] | None = None,
) -> ComposePlan:
    """Decide and validate a compose (see `compose.merge.compose_moe` for the options). Reads
    manifests, records and headers only; raises before anything is written. `base` and `weights`
    (DiLoCo rounds, compose/diloco.py): the checkpoint the deltas are taken from, and where each
    path's weights are, instead of base/ and work/<path>/final/."""
    from paths.base import require_base
    from paths.units import run_plan

    meta = require_base(run)
    if "diloco" in meta and weights is None:
        raise ConfigurationError(f"{run.url} trains in DiLoCo rounds: its composed model is composed/round-<last round>/, written by the worker that finished the round "
                                 "(its paths' finals are deltas from the last round's start, not from base/); ensemble them with --into ensemble")
    base = base or run.base
    plan, family, base_cfg = run_plan(run)
    prefix = run.composed(name)
    replaces = run.store.exists(f"{prefix}/manifest.json")
    if replaces and not overwrite:
        raise ConfigurationError(f"{run.store.url_of(prefix)} already exists: pass --overwrite or choose another --name")
    if router not in ("keep", "centroid", "domain-embed"):
        raise ConfigurationError(f"--router must be keep, centroid or domain-embed, got {router!r}")
    if router != "keep" and not router_data:
        raise ConfigurationError(f"--router {router} needs --router-data DATASET (the documents the paths were trained on)")
    if not 0 <= momentum < 1 or outer_lr <= 0:
        raise ConfigurationError(f"--momentum must be in [0, 1) and --outer-lr > 0, got {momentum} and {outer_lr}")
    out_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype) if dtype else None
    if dtype and out_dtype is None:
        raise ConfigurationError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    base_files = list(read_manifest(run.store, run.base)["files"])  # a round's start mirrors them (beside its own momentum and records)
    if out_dtype is not None and any(f.endswith(".index.json") for f in base_files):
        raise ConfigurationError("--dtype with a sharded base is not supported yet: compose in the base's dtype")
    ids, excluded = selection(run, plan, paths, include, exclude)
    if not ids:
        raise ConfigurationError(f"no finished path to compose in {run.url}: train some (`paths claim && paths train`) or name them with --paths")
    dropped = opt_out(plan, ids, excluded, int(base_cfg.get(family.top_k_field, 1)), family.router_groups(base_cfg))
    if dropped.active and (momentum > 0 or previous):
        raise ConfigurationError("--exclude/--include with --momentum or --previous: an opt-out build is for inference; compose it without momentum")
    if previous and momentum > 0:
        try:
            read_manifest(run.store, run.composed(previous))
        except NotFound:
            raise NotFound(f"--previous {previous}: no composed model {previous!r} in {run.url}: name the previous round's composed model") from None
    trained = [trained_path(run, pid, meta["base"]["checksum"], weighting, weights(pid) if weights else None) for pid in ids]
    files, weight_map, sources = [], {}, {}
    for fname in base_files:
        if not fname.endswith(".safetensors"):
            continue
        entries, metadata, _ = read_header(run.store, f"{base}/{fname}")
        out = OutputFile(fname, metadata, [], [])
        for e in sorted(entries.values(), key=lambda e: e.begin):
            if e.dtype not in DTYPES:
                raise IntegrityError(f"{run.store.url_of(e.key)}: tensor {e.name} has unsupported dtype {e.dtype}")
            target = out_tensor(family, e, dropped, out_dtype)
            if target is not None:
                out.inputs.append(e)
                out.outputs.append(target)
                weight_map[target.name] = fname
                sources[e.name] = tensor_sources(run, family, e, trained)
        files.append(out)
    return ComposePlan(
        name=name, prefix=prefix, overwrite=overwrite, replaces=replaces, family=family, plan=plan, base_checksum=meta["base"]["checksum"],
        ids=ids, excluded=excluded, dropped=dropped, trained=trained, outer_lr=outer_lr, momentum=momentum, weighting=weighting,
        previous=previous, dtype=dtype, out_dtype=out_dtype, router=router, router_data=router_data, router_docs=router_docs,
        base_files=base_files, files=files, weight_map=weight_map, sources=sources, base=base,
    )
