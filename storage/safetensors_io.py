"""safetensors without loading whole files: headers by ranged reads, tensors as byte ranges,
and a streaming writer whose memory is one tensor at a time.

Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the data; offsets are relative to the
data start and tensors are packed without gaps.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, Iterator

from storage.errors import IntegrityError
from storage.store import Store

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
MAX_HEADER = 100 << 20


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lies in one safetensors object."""

    key: str  # the store key of the file
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes of data."""
        return self.end - self.begin


def read_header(store: Store, key: str) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
    """(tensors by name, metadata, header bytes read) of a stored safetensors file, by two ranged
    reads; a file shorter than its header promises is reported with the first missing tensor."""
    size = store.size(key)
    where = store.url_of(key)
    if size < 8:
        raise IntegrityError(f"{where} is truncated ({size} bytes): restore it")
    (n,) = struct.unpack("<Q", store.read_range(key, 0, 8))
    if n > MAX_HEADER or 8 + n > size:
        raise IntegrityError(f"{where} has a corrupt or truncated safetensors header: restore it")
    try:
        header = json.loads(store.read_range(key, 8, 8 + n))
    except ValueError as exc:
        raise IntegrityError(f"{where} has an unreadable safetensors header ({exc}): restore it") from None
    metadata = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        entry = TensorEntry(key, name, info["dtype"], tuple(info["shape"]), 8 + n + b, 8 + n + e)
        expected = DTYPE_BYTES.get(entry.dtype, 0) * _numel(entry.shape)
        if expected and expected != entry.nbytes:
            raise IntegrityError(f"{where}: tensor {name} has {entry.nbytes} bytes for shape {list(entry.shape)} {entry.dtype}: restore the file")
        if entry.end > size:
            raise IntegrityError(f"{where} is truncated: tensor {name} ends at byte {entry.end}, the file has {size}: restore it")
        tensors[name] = entry
    return tensors, metadata, 8 + n


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def coalesce(entries: list[TensorEntry], max_gap: int = 0) -> list[list[TensorEntry]]:
    """Group entries of the same file whose byte ranges touch, so one ranged read serves several."""
    groups: list[list[TensorEntry]] = []
    for e in sorted(entries, key=lambda e: (e.key, e.begin)):
        last = groups[-1][-1] if groups else None
        if last is not None and last.key == e.key and 0 <= e.begin - last.end <= max_gap:
            groups[-1].append(e)
        else:
            groups.append([e])
    return groups


def read_plan(entries: list[TensorEntry], chunk: int = 8 << 20) -> list[tuple[str, int, int]]:
    """(key, begin, end) reads covering the entries in file order: touching ranges merged, then
    cut into pieces of at most `chunk` bytes so memory stays bounded whatever the tensor size."""
    out = []
    for group in coalesce(entries):
        key, begin, end = group[0].key, group[0].begin, group[-1].end
        for b in range(begin, end, chunk):
            out.append((key, b, min(end, b + chunk)))
    return out


def read_ranges(
    store: Store,
    plan: list[tuple[str, int, int]],
    on_read: Callable[[int, bytes], None] | None = None,
    workers: int = 4,
    window: int = 4,
) -> Iterator[bytes]:
    """The bytes of each planned read, in order, with up to `window` reads in flight on a thread
    pool (object stores answer concurrent ranged GETs much faster than sequential ones).
    `on_read(i, data)` runs in the worker right after read i (e.g. hashing, off the main thread);
    what it raises is raised here."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    def fetch(i: int, key: str, b: int, e: int) -> bytes:
        data = store.read_range(key, b, e)
        if on_read is not None:
            on_read(i, data)
        return data

    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        pending: deque = deque()
        for i, (key, b, e) in enumerate(plan):
            pending.append(pool.submit(fetch, i, key, b, e))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        # Never join here: a generator left unfinished is closed by the garbage collector, in
        # whatever thread it runs, even inside another thread's start (a join there deadlocks).
        pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True, slots=True)
class OutTensor:
    """A tensor to write: its name in the output, dtype, shape and bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def header_bytes(tensors: list[OutTensor], metadata: dict[str, str]) -> bytes:
    """The 8-byte length plus padded JSON header for tensors written in the given order."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_streaming(f: BinaryIO, tensors: list[OutTensor], chunks: Iterable[bytes], metadata: dict[str, str]) -> int:
    """Write a safetensors file: the header for `tensors` (packed in the given order), then the
    data as chunks whose concatenation is every tensor's bytes in that order."""
    f.write(header_bytes(tensors, metadata))
    expected = sum(t.nbytes for t in tensors)
    written = 0
    for chunk in chunks:
        f.write(chunk)
        written += len(chunk)
    if written != expected:
        raise IntegrityError(f"wrote {written} bytes of tensor data, expected {expected}")
    return written
