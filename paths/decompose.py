"""Cut the base MoE into paths, and materialize a path as a dense checkpoint by ranged reads.

A path is only `paths/<id>/path.json` (plan, expert per layer, base checksum, parameter count); its
weights are read from `base/` when needed: the safetensors headers, then exactly the byte ranges
of the shared tensors and of the chosen expert of each layer, streamed into a dense safetensors
file one tensor at a time. Exactness: the dense path's logits equal the MoE's when every router
is forced to the path's expert with weight 1 (tests/paths/test_decompose.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterator

from paths.base import base_config, base_tensors, count_parameters, require_base
from paths.errors import ConfigurationError, IntegrityError, NotFound
from paths.families import PARTS, Family, get_family
from paths.plan import Plan
from storage.layout import Run
from storage.manifest import ArtifactWriter, read_manifest, read_verified
from storage.safetensors_io import OutTensor, TensorEntry, read_plan, read_ranges, write_streaming

WEIGHTS = "model.safetensors"


def run_plan(run: Run, levels: int | None = None) -> tuple[Plan, Family, dict[str, Any]]:
    """The run's plan (from run.json, or a new one with `levels`), family and base config."""
    meta = require_base(run)
    family = get_family(meta["base"]["family"])
    config = base_config(run)
    if levels is None:
        if "plan" not in meta:
            raise ConfigurationError(f"{run.url} is not decomposed yet: run `paths decompose {run.url} --levels G`")
        levels = meta["plan"]["levels"]
    return Plan(config["num_hidden_layers"], family.num_experts(config), levels), family, config


@dataclass(frozen=True, slots=True)
class Piece:
    """One tensor of a dense path: its dense name and the byte range it comes from."""

    dense_name: str
    source: TensorEntry
    check: str  # key of its sha256 in the base manifest's `tensors`


def path_pieces(family: Family, tensors: dict[str, TensorEntry], experts: list[int]) -> list[Piece]:
    """The tensors a path needs, in dense names: shared ones as they are, and in each layer the
    chosen expert's projections (per-expert tensors, or slices of fused 3-D ones)."""
    pieces, fused = [], {}
    for name, entry in tensors.items():
        role = family.classify(name)
        if role.kind == "shared":
            pieces.append(Piece(name, entry, name))
        elif role.kind == "expert" and role.expert == experts[role.layer]:
            pieces.append(Piece(family.dense_mlp(role.layer, role.part), entry, name))
        elif role.kind == "fused":
            fused[(role.layer, role.part)] = entry
    for (layer, part), entry in fused.items():
        e = experts[layer]
        step = entry.nbytes // entry.shape[0]
        begin = entry.begin + e * step
        sub_shape = entry.shape[1:]
        if part == "gate_up":
            half = step // 2
            rows = sub_shape[0] // 2
            for k, p in enumerate(("gate", "up")):
                src = TensorEntry(entry.key, entry.name, entry.dtype, (rows, sub_shape[1]), begin + k * half, begin + (k + 1) * half)
                pieces.append(Piece(family.dense_mlp(layer, p), src, f"{entry.name}[{e}]"))
        else:
            src = TensorEntry(entry.key, entry.name, entry.dtype, sub_shape, begin, begin + step)
            pieces.append(Piece(family.dense_mlp(layer, "down"), src, f"{entry.name}[{e}]"))
    missing = [f"layer {layer} {p}" for layer in range(len(experts)) for p in PARTS if not any(x.dense_name == family.dense_mlp(layer, p) for x in pieces)]
    if missing:
        raise IntegrityError(f"base/ lacks expert tensors for {', '.join(missing[:3])}: the checkpoint does not match its family")
    return sorted(pieces, key=lambda p: p.dense_name)


def decompose(run: Run, levels: int, select: str = "all", materialize: bool = False) -> dict[str, Any]:
    """Write paths/<id>/path.json for the selected paths (and init/ checkpoints if asked)."""
    plan, family, config = run_plan(run, levels)
    meta = run.read_meta()
    if "plan" in meta and meta["plan"]["levels"] != levels:
        raise ConfigurationError(
            f"{run.url} is already decomposed with --levels {meta['plan']['levels']}: use a new run, or `paths next-round` for a new plan"
        )
    ids = plan.select(select)
    tensors, _ = base_tensors(run)
    shapes = {n: e.shape for n, e in tensors.items()}
    params = count_parameters(shapes, family, plan.num_experts)
    checksum = meta["base"]["checksum"]
    writer = ArtifactWriter(run.store, "paths")
    for files in _existing_path_files(run):
        writer.files.update(files)
    for pid in ids:
        experts = plan.experts_per_layer(pid)
        pieces = path_pieces(family, tensors, experts)
        writer.write_json(f"{pid}/path.json", {
            "path": pid,
            "plan": plan.to_json(),
            "experts": experts,
            "family": family.name,
            "base_checksum": checksum,
            "parameters": params["path"],
            "bytes": sum(p.source.nbytes for p in pieces),
        })
    writer.commit(kind="paths")
    run.update_meta(plan=plan.to_json())
    if materialize:
        for pid in ids:
            materialize_to_run(run, pid)
    return {"plan": plan.to_json(), "paths": ids, "parameters_per_path": params["path"]}


def _existing_path_files(run: Run) -> Iterator[dict[str, Any]]:
    """Entries of an earlier paths/manifest.json, so decomposing more paths keeps the old ones."""
    if run.store.exists("paths/manifest.json"):
        yield read_manifest(run.store, "paths")["files"]


def read_path(run: Run, path_id: str) -> dict[str, Any]:
    """paths/<id>/path.json, checked against the paths manifest and the current base."""
    plan, _, _ = run_plan(run)
    plan.parse(path_id)
    try:
        record = json.loads(read_verified(run.store, "paths", f"{path_id}/path.json"))
    except IntegrityError as exc:
        if "is not listed" in str(exc):
            raise ConfigurationError(f"path {path_id} was not decomposed in {run.url}: run `paths decompose {run.url} --levels {plan.levels} --paths {path_id}`") from None
        raise
    if record["base_checksum"] != run.read_meta()["base"]["checksum"]:
        raise IntegrityError(f"path {path_id} was cut from another base (checksum differs): decompose again")
    return record


def materialize(run: Run, path_id: str, out_dir: str) -> dict[str, Any]:
    """Write the dense path as a standalone HF checkpoint folder (local) by ranged reads of base/.

    Memory stays around one coalesced read (one expert's projections, or the embedding), never
    the whole path. Each tensor's bytes are checked against the base manifest's sha256.
    """
    start = time.perf_counter()
    record = read_path(run, path_id)
    _, family, config = run_plan(run)
    tensors, header_bytes = base_tensors(run)
    hashes = read_manifest(run.store, run.base).get("tensors", {})
    pieces = path_pieces(family, tensors, record["experts"])
    # Tensors are written in the order they lie in base/ (safetensors needs contiguous offsets,
    # not sorted names), so the planned reads stream straight into the output, a few chunks in
    # memory at a time, and each tensor's sha256 is checked as its bytes pass.
    pieces.sort(key=lambda p: (p.source.key, p.source.begin))
    order = [OutTensor(p.dense_name, p.source.dtype, p.source.shape, p.source.nbytes) for p in pieces]
    plan = read_plan([p.source for p in pieces])
    checker = _Checker(run, pieces, hashes, plan)
    chunks = (checker.feed(c) for c in read_ranges(run.store, plan, checker.on_read))
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f".{WEIGHTS}.partial")
    try:
        with open(tmp, "wb") as f:
            written = write_streaming(f, order, chunks, {"format": "pt", "paths.path": path_id})
    except BaseException:
        os.remove(tmp)  # nothing half-written is left behind
        raise
    checker.done()
    os.replace(tmp, os.path.join(out_dir, WEIGHTS))
    dense_cfg = family.dense_config(config)
    dense_cfg["dtype"] = config.get("dtype", "float32")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dense_cfg, f, indent=2, sort_keys=True)
    _copy_optional(run, "base", "generation_config.json", out_dir)
    for name in read_manifest(run.store, run.tokenizer)["files"]:
        _copy_optional(run, run.tokenizer, name, out_dir)
    with open(os.path.join(out_dir, "path.json"), "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
    return {
        "path": path_id,
        "out": out_dir,
        "bytes_written": written,
        "tensor_bytes_read": checker.total,
        "header_bytes_read": header_bytes,
        "seconds": round(time.perf_counter() - start, 3),
    }


class _Checker:
    """Checks each piece's sha256 against base/manifest.json as its bytes stream past.

    A piece that lies inside one planned read is hashed by the worker that read it (hashlib drops
    the GIL, so hashing runs beside the writes); a piece spread over several reads (the embedding)
    is hashed incrementally in order by `feed`.
    """

    def __init__(self, run: Run, pieces: list[Piece], hashes: dict[str, str], plan: list[tuple[str, int, int]]):
        self.run, self.pieces, self.hashes = run, pieces, hashes
        self.inside: list[list[int]] = []
        spanning = set(range(len(pieces)))
        j = 0
        for key, b, e in plan:
            here = []
            while j < len(pieces) and pieces[j].source.key == key and pieces[j].source.end <= e:
                src = pieces[j].source
                if src.begin >= b:
                    here.append(j)
                    spanning.discard(j)
                j += 1
            self.inside.append(here)
        # Pieces spanning reads, with the bytes still to come of the current one.
        self.spanning = sorted(spanning)
        self.total = 0
        self._h = hashlib.sha256()
        self._k = 0
        self._plan = plan
        self._chunk = 0

    def _verify(self, i: int, digest: str) -> None:
        piece = self.pieces[i]
        want = self.hashes.get(piece.check)
        if want is not None and digest != want:
            raise IntegrityError(
                f"{self.run.store.url_of(piece.source.key)}: tensor {piece.source.name} does not match its sha256 in base/manifest.json: restore the file"
            )

    def on_read(self, c: int, data: bytes) -> None:
        """In a worker: hash the pieces wholly inside read c."""
        _, b, _ = self._plan[c]
        view = memoryview(data)
        for i in self.inside[c]:
            src = self.pieces[i].source
            self._verify(i, hashlib.sha256(view[src.begin - b : src.end - b]).hexdigest())

    def feed(self, data: bytes) -> bytes:
        """In order, on the main thread: hash the parts of spanning pieces in this read."""
        key, b, e = self._plan[self._chunk]
        self._chunk += 1
        self.total += len(data)
        view = memoryview(data)
        while self._k < len(self.spanning):
            src = self.pieces[self.spanning[self._k]].source
            if src.key != key or src.begin >= e:
                break
            lo, hi = max(src.begin, b), min(src.end, e)
            self._h.update(view[lo - b : hi - b])
            if src.end > e:
                break
            self._verify(self.spanning[self._k], self._h.hexdigest())
            self._h, self._k = hashlib.sha256(), self._k + 1
        return data

    def done(self) -> None:
        assert self._k == len(self.spanning) and self._chunk == len(self._plan), "every piece was read and checked"


def _copy_optional(run: Run, prefix: str, name: str, out_dir: str) -> None:
    if name in read_manifest(run.store, prefix)["files"]:
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(read_verified(run.store, prefix, name))


def materialize_to_run(run: Run, path_id: str) -> None:
    """Write paths/<id>/init/ (a standalone dense checkpoint) into the run, with a manifest."""
    tmp = tempfile.mkdtemp(prefix="paths-mat-")
    try:
        materialize(run, path_id, tmp)
        writer = ArtifactWriter(run.store, run.path_init(path_id))
        for name in sorted(os.listdir(tmp)):
            writer.upload(name, os.path.join(tmp, name))
        writer.commit(kind="path-init", path=path_id)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def describe(run: Run, levels: int | None = None) -> dict[str, Any]:
    """What `paths plan` shows: levels, layers per level, paths, parameters per path and in all."""
    meta = require_base(run)
    if levels is None and "plan" not in meta:
        levels = 1
    plan, family, _ = run_plan(run, levels)
    tensors, _ = base_tensors(run)
    params = count_parameters({n: e.shape for n, e in tensors.items()}, family, plan.num_experts)
    return summarize(plan, family.name, params, decomposed="plan" in meta)


def summarize(plan: Plan, family: str, params: dict[str, int], decomposed: bool) -> dict[str, Any]:
    """The plan table's content from a plan and parameter counts."""
    return {
        "family": family,
        "decomposed": decomposed,
        "levels": plan.levels,
        "layers_per_level": [len(r) for r in plan.level_layers],
        "level_layers": [[r.start, r.stop - 1] for r in plan.level_layers],
        "experts_per_layer": plan.num_experts,
        "paths": plan.num_paths,
        "parameters_per_path": params["path"],
        "parameters_total": params["total"],
        "parameters_shared": params["shared"],
        "example_path": plan.path_id(tuple([0] * plan.levels)),
    }


def decomposed_paths(run: Run) -> tuple[Plan, list[str]]:
    """The plan and the ids of every decomposed path, in plan order."""
    plan, _, _ = run_plan(run)
    try:
        files = read_manifest(run.store, "paths")["files"]
    except NotFound:
        raise ConfigurationError(f"{run.url} is not decomposed yet: run `paths decompose {run.url} --levels G`") from None
    ids = sorted({name.split("/", 1)[0] for name in files if name.endswith("/path.json")})
    return plan, ids
