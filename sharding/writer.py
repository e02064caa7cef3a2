"""Per-path zarr v3 groups, written from the staged parts in input order.

Group `data/<dataset>/<path>.zarr`:

```
tokens               uint32 (T,)     the path's documents, concatenated, each ending in EOS
doc_offsets          uint64 (D+1,)   document d is tokens[doc_offsets[d]:doc_offsets[d+1]]
heldout_tokens, heldout_doc_offsets  the held-out documents, the same way
prompt_utf8, prompt_offsets, answer_utf8, answer_offsets    (--kind prompts) texts as UTF-8
fields_utf8, fields_offsets  (--kind prompts) each record's other fields: one compact JSON object
                             as UTF-8, empty when it has none (text files; datasets before format 2
                             have no such arrays)
```

Token arrays have chunks of `chunk_tokens` (1M: 4 MiB) inside shards of `shard_tokens` (16M:
64 MiB) in zarr's sharding codec (an array shorter than a chunk is one chunk of its own length),
zstd-compressed with frame checksums, so a corrupt chunk fails to decode instead of yielding
wrong tokens. `write_groups` encodes these objects itself (zarr's bytes, see there) and writes
them straight into the run's storage, recording each one's size and sha256; the dataset
manifest, written after all groups, lists them, so a group from a killed run is never read.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from storage.store import Store

FIELDS_DOCUMENTS = ("tokens",)
FIELDS_PROMPTS = ("tokens", "prompt", "answer", "fields")
SPLITS = ("train", "heldout")
_DTYPE = {"tokens": np.uint32, "prompt": np.uint8, "answer": np.uint8, "fields": np.uint8}


def array_names(field_name: str, split: str) -> tuple[str, str]:
    """(values, offsets) array names of a field in a split."""
    head = "" if split == "train" else "heldout_"
    if field_name == "tokens":
        return f"{head}tokens", f"{head}doc_offsets"
    return f"{head}{field_name}_utf8", f"{head}{field_name}_offsets"


@dataclass(slots=True)
class MemoryBudget:
    """Bytes of path data all buffers may hold in memory together before they spill to disk."""

    limit: int
    used: int = 0
    buffers: list["PathBuffer"] = field(default_factory=list)

    def add(self, n: int) -> None:
        self.used += n
        if self.used > self.limit:
            for b in self.buffers:
                b.spill()
            self.used = 0


@dataclass(slots=True)
class PathBuffer:
    """One path's values for every (split, field), in document order: in memory, spilled to
    local files when the shared budget is exceeded (so memory stays bounded on any dataset)."""

    folder: str
    fields: tuple[str, ...]
    budget: MemoryBudget
    pending: dict[tuple[str, str], list[np.ndarray]] = field(default_factory=dict)
    lengths: dict[tuple[str, str], list[np.ndarray]] = field(default_factory=dict)
    spilled: set[tuple[str, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.budget.buffers.append(self)

    def append(self, split: str, name: str, values: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents' values (flat) and their lengths."""
        key = (split, name)
        self.pending.setdefault(key, []).append(values.astype(_DTYPE[name], copy=False))
        self.lengths.setdefault(key, []).append(lengths.astype(np.int64, copy=False))
        self.budget.add(values.nbytes)

    def _path(self, key: tuple[str, str]) -> str:
        return os.path.join(self.folder, f"{key[0]}.{key[1]}.bin")

    def spill(self) -> None:
        """Move what is in memory to the end of the local files."""
        os.makedirs(self.folder, exist_ok=True)
        for key, chunks in self.pending.items():
            if chunks:
                with open(self._path(key), "ab") as f:
                    for c in chunks:
                        f.write(c.tobytes())
                self.spilled.add(key)
        self.pending = {}

    def close(self) -> None:
        """Everything appended is in place (a file if anything was spilled)."""
        if self.spilled:
            self.spill()

    def arrays(self, split: str, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(values: in memory, or a read-only memmap; offsets uint64)."""
        key = (split, name)
        lengths = np.concatenate(self.lengths[key]) if self.lengths.get(key) else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.uint64)
        np.cumsum(lengths, out=offsets[1:])
        if key in self.spilled and os.path.getsize(self._path(key)):
            return np.memmap(self._path(key), dtype=_DTYPE[name], mode="r"), offsets
        chunks = self.pending.get(key, [])
        return (np.concatenate(chunks) if chunks else np.zeros(0, dtype=_DTYPE[name])), offsets


def write_groups(store: Store, jobs: list[tuple[str, PathBuffer, dict[str, Any]]], chunk_tokens: int, shard_tokens: int, threads: int = 4) -> list[tuple[dict[str, int], dict[str, dict[str, Any]]]]:
    """Write every path's zarr group, job = (group key, buffer, attributes); per job the counts
    (documents and tokens per split) and the objects written ({name in the group: size, sha256}).

    The objects are encoded here, not through zarr's array API: zarr's per-array machinery (an
    event loop hop, a store round trip and a codec pipeline per chunk) cost 2.5x the compression
    itself on a 16-path dataset. The bytes are zarr's own (its metadata classes serialise the
    zarr.json objects; chunks are numcodecs' zstd, the shard index crc32c-checked as zarr does),
    so zarr reads them and a test holds them byte-identical to zarr's writer. Every shard of
    every array is one task on `threads` threads: zstd and the writes run in parallel, and the
    encoded bytes in flight stay ~ threads x one shard (the values are the buffers' arrays)."""
    from concurrent.futures import ThreadPoolExecutor

    import google_crc32c  # noqa: F401  first imported here, in one thread: pool threads importing zarr at once fail (a circular import)
    import numcodecs  # noqa: F401
    import zarr.core.group  # noqa: F401
    import zarr.core.metadata.v3  # noqa: F401

    offsets_chunk = max(1, chunk_tokens // 8)  # a shard of offsets holds as many chunks as a shard of values
    offsets_shard = shard_tokens // chunk_tokens * offsets_chunk
    results: list[tuple[dict[str, int], dict[str, dict[str, Any]]]] = []
    tasks = []
    for key, buffer, attributes in jobs:
        counts: dict[str, int] = {}
        files: dict[str, dict[str, Any]] = {}
        tasks.append((key, files, "zarr.json", lambda a=attributes: _group_json(a)))
        for split in SPLITS:
            for name in buffer.fields:
                values, offsets = buffer.arrays(split, name)
                vname, oname = array_names(name, split)
                for aname, array, chunk, shard in ((vname, values, chunk_tokens, shard_tokens), (oname, offsets, offsets_chunk, offsets_shard)):
                    chunk, shard = _layout(len(array), chunk, shard)
                    tasks.append((key, files, f"{aname}/zarr.json", lambda n=len(array), d=array.dtype, c=chunk, s=shard: _array_json(n, d, c, s)))
                    for i, begin in enumerate(range(0, len(array), shard)):
                        tasks.append((key, files, f"{aname}/c/{i}", lambda a=array, b=begin, c=chunk, s=shard: _encode_shard(a[b : b + s], c, s)))
                if name == "tokens":
                    counts[f"{split}_docs"] = len(offsets) - 1
                    counts[f"{split}_tokens"] = int(offsets[-1])
        results.append((counts, files))

    def run(task: tuple[str, dict, str, Callable[[], bytes]]) -> None:
        key, files, name, encode = task
        data = encode()
        store.write(f"{key}/{name}", data)
        files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    with ThreadPoolExecutor(max(1, threads)) as pool:
        for _ in pool.map(run, tasks):
            pass
    return results


def _layout(n: int, chunk: int, shard: int) -> tuple[int, int]:
    """(chunk, shard) of an array of n values: an array no longer than a chunk is one chunk of
    its own length (no padding to compress and store); a shard no longer than the array needs."""
    if n <= chunk:
        return max(1, n), max(1, n)
    return chunk, min(shard, -(-n // chunk) * chunk)


def _encode_shard(values: np.ndarray, chunk: int, shard: int) -> bytes:
    """One shard as zarr's sharding codec lays it out: each inner chunk (the last one padded with
    the fill value 0) little-endian, zstd level 3 with a frame checksum, back to back; then the
    index, (offset, length) uint64 per chunk (2^64-1 twice for a chunk past the array's end),
    and the index's crc32c."""
    import google_crc32c

    index = np.full((shard // chunk, 2), np.iinfo(np.uint64).max, dtype="<u8")
    parts, at = [], 0
    for j in range(shard // chunk):
        piece = np.asarray(values[j * chunk : (j + 1) * chunk])
        if not len(piece):
            break
        if len(piece) < chunk:
            piece = np.concatenate([piece, np.zeros(chunk - len(piece), piece.dtype)])
        data = _zstd().encode(np.ascontiguousarray(piece, dtype=piece.dtype.newbyteorder("<")))
        parts.append(data)
        index[j] = (at, len(data))
        at += len(data)
    raw = index.tobytes()
    return b"".join(parts) + raw + np.array([google_crc32c.value(raw)], dtype="<u4").tobytes()


def _zstd() -> Any:
    from numcodecs import Zstd

    return Zstd(level=3, checksum=True)


def _array_json(n: int, dtype: np.dtype, chunk: int, shard: int) -> bytes:
    """The zarr.json of a 1-D sharded array, serialised by zarr's own metadata class."""
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.metadata.v3 import ArrayV3Metadata

    template = _array_template(np.dtype(dtype).str)
    sharding = template["codecs"][0]
    meta = ArrayV3Metadata.from_dict({**template, "shape": [n], "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [shard]}},
                                      "codecs": [{**sharding, "configuration": {**sharding["configuration"], "chunk_shape": [chunk]}}]})
    return meta.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()


@functools.lru_cache(maxsize=None)
def _array_template(dtype: str) -> dict[str, Any]:
    """The metadata zarr writes for our arrays of this dtype (create_array's defaults filled in),
    little-endian on any host, as `_encode_shard` writes (zarr's default follows the host's)."""
    import zarr
    from zarr.codecs import BytesCodec, ZstdCodec

    arr = zarr.create_array(store=zarr.storage.MemoryStore(), shape=(0,), dtype=np.dtype(dtype), chunks=(1,), shards=(1,), serializer=BytesCodec(endian="little"),
                            compressors=ZstdCodec(level=3, checksum=True), fill_value=0)
    meta = arr.metadata.to_dict()
    for codec in meta["codecs"][0]["configuration"]["index_codecs"]:  # the shard index too
        if codec["name"] == "bytes":
            codec["configuration"] = {"endian": "little"}
    return meta


def _group_json(attributes: dict[str, Any]) -> bytes:
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.group import GroupMetadata

    return GroupMetadata(attributes=attributes).to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()


def group_checksum(files: dict[str, dict[str, Any]], prefix: str) -> str:
    """One sha256 over the (name, sha256) of a group's files."""
    h = hashlib.sha256()
    for name in sorted(files):
        if name.startswith(prefix):
            h.update(f"{name[len(prefix):]}\0{files[name]['sha256']}\n".encode())
    return h.hexdigest()
