"""Model and artifact I/O: every way a run's weights become a verified local folder.

`resolve_model(run, spec, out)` is the one entry point: `base`, `path:ID` (cut from base/ by
ranged reads), `expert:NAME` (its starting weights), `final:UNIT` (a trained path or expert),
`composed:NAME` (a composed MoE or ensemble) or `hf:DIR` (a local Hugging Face folder). Committed
artifacts are checked against their manifests and, on a remote store, cached under PATHS_HOME by
their manifest's hash; on a local store they are read in place.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from paths.base import base_tensors, require_base
from paths.errors import ConfigurationError, IntegrityError, NotFound
from paths.families import PARTS, Family, fill
from paths.tokenizer import load_tokenizer
from paths.units import read_path, run_plan
from storage.layout import Run
from storage.manifest import download, read_manifest, sha256_hex
from storage.safetensors_io import OutTensor, TensorEntry, read_plan, read_ranges, write_streaming


WEIGHTS = "model.safetensors"


@dataclass(frozen=True, slots=True)
class Piece:
    """One tensor of a dense path: its dense name and the byte range it comes from."""

    dense_name: str
    source: TensorEntry
    check: str  # key of its sha256 in the base manifest's `tensors`


def path_pieces(family: Family, tensors: dict[str, TensorEntry], experts: list[int]) -> list[Piece]:
    """The tensors a path needs, in its own names: shared ones as they are, and in each layer the
    chosen expert's projections (per-expert tensors, or slices of fused 3-D ones); a "moe" path
    also its router's row of the chosen expert (and of its extras, such as a router bias), and
    keeps a fused expert tensor fused, as its one-expert slice."""
    pieces, fused = [], {}
    for name, entry in tensors.items():
        role = family.classify(name)
        if role.kind == "shared":
            pieces.append(Piece(name, entry, name))
        elif role.kind == "router" and not family.has_dense_sibling and family.path_router == "row":
            e = experts[role.layer]
            step = entry.nbytes // entry.shape[0]
            row = TensorEntry(entry.key, entry.name, entry.dtype, (1, *entry.shape[1:]), entry.begin + e * step, entry.begin + (e + 1) * step)
            pieces.append(Piece(name, row, f"{name}[{e}]"))
        elif role.kind == "expert" and role.expert == experts[role.layer]:
            pieces.append(Piece(family.dense_mlp(role.layer, role.part), entry, name))
        elif role.kind == "fused":
            fused[(role.layer, role.part)] = entry
    for (layer, part), entry in fused.items():
        e = experts[layer]
        step = entry.nbytes // entry.shape[0]
        begin = entry.begin + e * step
        sub_shape = entry.shape[1:]
        if not family.has_dense_sibling:  # its own class: the same fused tensor with one expert
            pieces.append(Piece(entry.name, TensorEntry(entry.key, entry.name, entry.dtype, (1, *sub_shape), begin, begin + step), f"{entry.name}[{e}]"))
        elif part == "gate_up":
            half = step // 2
            rows = sub_shape[0] // 2
            for k, p in enumerate(("gate", "up")):
                src = TensorEntry(entry.key, entry.name, entry.dtype, (rows, sub_shape[1]), begin + k * half, begin + (k + 1) * half)
                pieces.append(Piece(family.dense_mlp(layer, p), src, f"{entry.name}[{e}]"))
        else:
            src = TensorEntry(entry.key, entry.name, entry.dtype, sub_shape, begin, begin + step)
            pieces.append(Piece(family.dense_mlp(layer, "down"), src, f"{entry.name}[{e}]"))
    missing = [f"layer {layer} {p}" for layer in range(len(experts)) for p in PARTS if experts[layer] >= 0 and not any(x.dense_name == family.dense_mlp(layer, p) for x in pieces)]
    if missing:
        raise IntegrityError(f"base/ lacks expert tensors for {', '.join(missing[:3])}: the checkpoint does not match its family")
    return sorted(pieces, key=lambda p: p.dense_name)


def path_fills(family: Family, tensors: dict[str, TensorEntry], experts: list[int]) -> list[tuple[OutTensor, bytes]]:
    """The tensors a padded "moe" path holds that no base bytes give (families.py `[path]`): the
    experts after the chosen one (zeros, never chosen), a zero router, and the router extras'
    values."""
    if family.has_dense_sibling or (family.path_experts == 1 and family.path_router == "row" and not family.path_fill):
        return []
    out: list[tuple[OutTensor, bytes]] = []

    def add(name: str, dtype: str, values: torch.Tensor) -> None:
        data = values.to(DTYPES[dtype]).contiguous().view(torch.uint8).numpy().tobytes()
        out.append((OutTensor(name, dtype, tuple(values.shape), len(data)), data))

    for layer in (layer for layer, e in enumerate(experts) if e >= 0):  # a dense layer has no router
        router = tensors[fill(family.router["disk"], layer)]
        if family.path_router == "zeros":
            add(fill(family.router["disk"], layer), router.dtype, torch.zeros(family.path_experts, *router.shape[1:]))
        for template, values in (family.path_fill or {}).items():
            name = fill(template, layer)
            if name not in tensors:
                raise IntegrityError(f"base/ lacks {name}, which configs/families/{family.name}.toml fills in a path: the checkpoint does not match its family")
            add(name, tensors[name].dtype, torch.tensor(values, dtype=torch.float64))
        for k in range(1, family.path_experts):
            for part in PARTS:
                like = tensors[family.disk_expert(layer, 0, part)]
                add(family.disk_expert(layer, k, part), like.dtype, torch.zeros(like.shape))
    return out


def materialize(run: Run, path_id: str, out_dir: str, source: str | None = None) -> dict[str, Any]:
    """Write the dense path as a standalone HF checkpoint folder (local) by ranged reads of base/
    (or of `source`, another MoE checkpoint of the run holding per-tensor hashes, such as a DiLoCo
    round's composed/round-<r>/).

    Memory stays around one coalesced read (one expert's projections, or the embedding), never
    the whole path. Each tensor's bytes are checked against the source manifest's sha256.
    """
    start = time.perf_counter()
    record = read_path(run, path_id)
    _, family, config = run_plan(run)
    source = source or run.base
    tensors, header_bytes = base_tensors(run, source)
    hashes = read_manifest(run.store, source).get("tensors", {})
    if source != run.base and not hashes:
        raise IntegrityError(f"{run.store.url_of(source)}/manifest.json holds no per-tensor sha256: a path is cut only from a checkpoint whose tensors can be checked")
    pieces = path_pieces(family, tensors, record["experts"])
    # Tensors are written in the order they lie in base/ (safetensors needs contiguous offsets,
    # not sorted names), so the planned reads stream straight into the output, a few chunks in
    # memory at a time, and each tensor's sha256 is checked as its bytes pass.
    pieces.sort(key=lambda p: (p.source.key, p.source.begin))
    order = [OutTensor(p.dense_name, p.source.dtype, p.source.shape, p.source.nbytes) for p in pieces]
    fills = path_fills(family, tensors, record["experts"])
    order += [t for t, _ in fills]
    plan = read_plan([p.source for p in pieces])
    checker = _Checker(run, pieces, hashes, plan, source)
    chunks = itertools.chain((checker.feed(c) for c in read_ranges(run.store, plan, checker.on_read)), (data for _, data in fills))
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
    download(run.store, source, out_dir, lambda n: n if n == "generation_config.json" else None)
    download(run.store, run.tokenizer, out_dir)
    with open(os.path.join(out_dir, "path.json"), "w") as f:
        json.dump({**record, "form": family.path_form}, f, indent=2, sort_keys=True)
    return {
        "path": path_id,
        "out": out_dir,
        "bytes_written": written,
        "tensor_bytes_read": checker.total,
        "header_bytes_read": header_bytes,
        "seconds": round(time.perf_counter() - start, 3),
    }


class _Checker:
    """Checks each piece's sha256 against its source manifest (base/manifest.json) as its bytes stream past.

    A piece that lies inside one planned read is hashed by the worker that read it (hashlib drops
    the GIL, so hashing runs beside the writes); a piece spread over several reads (the embedding)
    is hashed incrementally in order by `feed`.
    """

    def __init__(self, run: Run, pieces: list[Piece], hashes: dict[str, str], plan: list[tuple[str, int, int]], source: str):
        self.run, self.pieces, self.hashes, self.source = run, pieces, hashes, source
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
                f"{self.run.store.url_of(piece.source.key)}: tensor {piece.source.name} does not match its sha256 in {self.source}/manifest.json: restore the file"
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


def fetch_dir(run: Run, prefix: str) -> str:
    """A local folder holding a committed artifact (base/, tokenizer/, a checkpoint): the folder
    itself for a local run, else a verified download into a cache keyed by the manifest's hash."""
    from storage.manifest import MANIFEST

    manifest = read_manifest(run.store, prefix)
    if (path := run.store.local_path(prefix)) is not None:
        return path
    key = sha256_hex(json.dumps(manifest["files"], sort_keys=True).encode())[:16]
    home = os.environ.get("PATHS_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "paths")
    folder = os.path.join(home, "artifacts", f"{prefix.replace('/', '_')}-{key}")
    if os.path.exists(os.path.join(folder, MANIFEST)):
        return folder
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".fetch-", dir=os.path.dirname(folder))
    manifest = download(run.store, prefix, tmp)
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f)
    try:
        os.rename(tmp, folder)
    except OSError:  # another process fetched it first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def run_tokenizer(run: Run):
    """The run's shared tokenizer (fast), and the sha256 that names it."""
    meta = run.read_meta()
    if "tokenizer" not in meta:
        raise NotFound(f"{run.url} has no tokenizer: run `paths init {run.url} ...` first")
    return load_tokenizer(fetch_dir(run, run.tokenizer)), meta["tokenizer"]["checksum"]


def load_base_model(run: Run):
    """The base MoE as a float32 transformers model in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    require_base(run)
    hf_logging.disable_progress_bar()  # our own progress bars say what is happening
    return AutoModelForCausalLM.from_pretrained(fetch_dir(run, run.base), dtype=torch.float32).eval()


def fetch_final(run: Run, path_id: str, out: str) -> dict[str, Any]:
    """Download work/<path>/final/ (checked against its manifest); its provenance."""
    if not run.store.exists(f"{run.final(path_id)}/manifest.json"):
        raise NotFound(f"path {path_id} has no final/ to start from in {run.url}: train it first, or use --init base")
    download(run.store, run.final(path_id), out)
    with open(os.path.join(out, "provenance.json")) as f:
        return json.load(f)


def materialize_expert(run: Run, name: str, out: str) -> dict[str, Any]:
    """The expert's starting checkpoint in `out` (verified), with expert.json; its expert.json."""
    download(run.store, run.expert(name), out, lambda n: n[len("init/"):] if n.startswith("init/") else None)
    with open(os.path.join(out, "expert.json")) as f:
        return json.load(f)


# -- the one model resolver -------------------------------------------------------------------
MODEL_KINDS = ("base", "path", "expert", "composed", "hf")


@dataclass(frozen=True, slots=True)
class ModelRef:
    """A model named on the command line: `base`, `path:ID`, `expert:NAME`, `composed:NAME`, `hf:DIR`."""

    kind: str
    name: str = ""

    @property
    def spec(self) -> str:
        return self.kind if self.kind == "base" else f"{self.kind}:{self.name}"


def parse_model(spec: str, kinds: tuple[str, ...] = MODEL_KINDS, option: str = "--model") -> ModelRef:
    """Parse a model spec, refusing kinds the caller cannot use (named in the message)."""
    kind, _, name = spec.partition(":")
    ok = (kind == "base" and not name) or (kind in MODEL_KINDS and kind != "base" and bool(name))
    if not ok or kind not in kinds:
        forms = {"base": "base", "path": "path:ID", "expert": "expert:NAME", "composed": "composed:NAME", "hf": "hf:DIR"}
        names = [forms[k] for k in kinds]
        raise ConfigurationError(f"{option} {spec!r}: use {', '.join(names[:-1]) + ' or ' if len(names) > 1 else ''}{names[-1]}")
    return ModelRef(kind, name)


@dataclass(frozen=True, slots=True)
class Resolved:
    """A model as a verified local folder, the folder its tokenizer loads from, and what it is."""

    ref: ModelRef
    folder: str
    tokenizer_folder: str
    ensemble: bool


def resolve_model(run: Run, spec: str | ModelRef, scratch: str, kinds: tuple[str, ...] = MODEL_KINDS, option: str = "--model") -> Resolved:
    """The one way from a model spec to a local folder. On a remote store every artifact is
    downloaded once (verified) into PATHS_HOME's cache, keyed by its manifest's hash; on a local
    run base and composed models are read in place and a trained path or expert's final/ is
    copied (verified) into `scratch`; hf:DIR is used as it is. The folder is read-only to callers."""
    ref = spec if isinstance(spec, ModelRef) else parse_model(spec, kinds, option)
    if ref.kind == "base":
        require_base(run)
        folder, tok = fetch_dir(run, run.base), fetch_dir(run, run.tokenizer)
    elif ref.kind in ("path", "expert") and run.store.local_path(run.final(ref.name)) is None:
        try:  # remote: downloaded once, verified, into the cache keyed by the manifest's hash
            folder = tok = fetch_dir(run, run.final(ref.name))
        except NotFound:
            raise NotFound(f"{option} {ref.spec}: {ref.name} has no final/ in {run.url}: train it first (`paths claim && paths train`)") from None
    elif ref.kind in ("path", "expert"):
        folder = tok = os.path.join(scratch, f"{ref.kind}-{ref.name}")  # local: a verified copy
        if not os.path.exists(os.path.join(folder, "provenance.json")):
            fetch_final(run, ref.name, folder)
    elif ref.kind == "composed":
        try:
            folder = tok = fetch_dir(run, run.composed(ref.name))
        except NotFound:
            raise NotFound(f"{option} {ref.spec}: no composed model {ref.name!r} in {run.url}: run `paths compose {run.url} --name {ref.name}` first") from None
    else:
        folder = tok = ref.name
        if not os.path.exists(os.path.join(folder, "config.json")):
            raise ConfigurationError(f"{option} {ref.spec}: no config.json in {folder}: give a Hugging Face checkpoint folder")
    with open(os.path.join(folder, "config.json")) as f:
        ensemble = json.load(f).get("model_type") == "paths_ensemble"  # ours: its modeling file ships inside
    if ensemble:
        tok = fetch_dir(run, run.tokenizer)  # the same files; AutoTokenizer would read the remote-code config
    return Resolved(ref, folder, tok, ensemble)


def load_model(run: Run, spec: str | ModelRef, scratch: str, kinds: tuple[str, ...] = MODEL_KINDS, option: str = "--model"):
    """(model in float32 eval mode, tokenizer, Resolved) for a model spec."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    resolved = resolve_model(run, spec, scratch, kinds, option)
    try:
        model = AutoModelForCausalLM.from_pretrained(resolved.folder, dtype=torch.float32, trust_remote_code=resolved.ensemble).eval()
        tokenizer = AutoTokenizer.from_pretrained(resolved.tokenizer_folder)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"{option} {resolved.ref.spec}: cannot load {resolved.folder} ({exc})") from None
    return model, tokenizer, resolved


DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def load_tensor(run: Run, entry: TensorEntry) -> torch.Tensor:
    """One tensor by a ranged read."""
    if entry.dtype not in DTYPES:
        raise IntegrityError(f"{run.store.url_of(entry.key)}: tensor {entry.name} has unsupported dtype {entry.dtype}")
    if entry.begin == entry.end:
        return torch.zeros(entry.shape, dtype=DTYPES[entry.dtype])
    local = run.store.local_path(entry.key)
    if local is not None:  # a read-only map of the file: no copy at all
        import numpy as np

        raw = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}[entry.dtype]
        mapped = np.memmap(local, dtype=raw, mode="r", offset=entry.begin, shape=tuple(entry.shape))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(mapped)
        return t.view(torch.bfloat16) if entry.dtype == "BF16" else t
    data = run.store.read_range(entry.key, entry.begin, entry.end)
    with warnings.catch_warnings():  # read-only view of the bytes: nothing writes to it, no copy
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=DTYPES[entry.dtype]).reshape(entry.shape)
