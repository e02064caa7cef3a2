"""Per-path zarr v3 groups, written from the staged parts in input order.

Group `data/<dataset>/<path>.zarr`:

```
tokens               uint32 (T,)     the path's documents, concatenated, each ending in EOS
doc_offsets          uint64 (D+1,)   document d is tokens[doc_offsets[d]:doc_offsets[d+1]]
heldout_tokens, heldout_doc_offsets  the held-out documents, the same way
prompt_utf8, prompt_offsets, answer_utf8, answer_offsets    (--kind prompts) texts as UTF-8
```

Token arrays have chunks of `chunk_tokens` (1M: 4 MiB) inside shards of `shard_tokens` (16M:
64 MiB) via zarr's sharding codec, zstd-compressed with frame checksums, so a corrupt chunk fails
to decode instead of yielding wrong tokens. Each group is built in a local folder, then uploaded
file by file with its sha256 recorded; the dataset manifest is written after all of them.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

FIELDS_DOCUMENTS = ("tokens",)
FIELDS_PROMPTS = ("tokens", "prompt", "answer")
SPLITS = ("train", "heldout")
_DTYPE = {"tokens": np.uint32, "prompt": np.uint8, "answer": np.uint8}


def array_names(field_name: str, split: str) -> tuple[str, str]:
    """(values, offsets) array names of a field in a split."""
    head = "" if split == "train" else "heldout_"
    if field_name == "tokens":
        return f"{head}tokens", f"{head}doc_offsets"
    return f"{head}{field_name}_utf8", f"{head}{field_name}_offsets"


@dataclass(slots=True)
class PathBuffer:
    """One path's values for every (split, field), appended to local files as parts stream by."""

    folder: str
    fields: tuple[str, ...]
    lengths: dict[tuple[str, str], list[np.ndarray]] = field(default_factory=dict)
    files: dict[tuple[str, str], BinaryIO] = field(default_factory=dict)

    def _file(self, split: str, name: str) -> BinaryIO:
        key = (split, name)
        if key not in self.files:
            self.files[key] = open(os.path.join(self.folder, f"{split}.{name}.bin"), "wb")
            self.lengths[key] = []
        return self.files[key]

    def append(self, split: str, name: str, values: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents' values (flat) and their lengths."""
        self._file(split, name).write(values.astype(_DTYPE[name], copy=False).tobytes())
        self.lengths[(split, name)].append(lengths.astype(np.int64, copy=False))

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def arrays(self, split: str, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(values as a read-only memmap or empty array, offsets uint64)."""
        key = (split, name)
        lengths = np.concatenate(self.lengths[key]) if self.lengths.get(key) else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.uint64)
        np.cumsum(lengths, out=offsets[1:])
        path = os.path.join(self.folder, f"{split}.{name}.bin")
        if not os.path.exists(path) or os.path.getsize(path) == 0:
            return np.zeros(0, dtype=_DTYPE[name]), offsets
        return np.memmap(path, dtype=_DTYPE[name], mode="r"), offsets


def write_group(buffer: PathBuffer, out: str, chunk_tokens: int, shard_tokens: int, attributes: dict[str, Any]) -> dict[str, int]:
    """Write one path's zarr group into a local folder; returns document and token counts."""
    import zarr
    from zarr.codecs import ZstdCodec

    group = zarr.open_group(zarr.storage.LocalStore(out), mode="w", attributes=attributes)
    counts: dict[str, int] = {}
    for split in SPLITS:
        for name in buffer.fields:
            values, offsets = buffer.arrays(split, name)
            vname, oname = array_names(name, split)
            _write_array(group, vname, values, chunk_tokens, shard_tokens)
            _write_array(group, oname, offsets, max(1, chunk_tokens // 8), max(1, shard_tokens // 8))
            if name == "tokens":
                counts[f"{split}_docs"] = len(offsets) - 1
                counts[f"{split}_tokens"] = int(offsets[-1])
    return counts


def _write_array(group, name: str, values: np.ndarray, chunk: int, shard: int) -> None:
    from zarr.codecs import ZstdCodec

    arr = group.create_array(
        name, shape=values.shape, dtype=values.dtype, chunks=(chunk,), shards=(shard,),
        compressors=ZstdCodec(level=3, checksum=True), fill_value=0,
    )
    for begin in range(0, len(values), shard):  # one shard at a time: memory stays ~ one shard
        arr[begin : begin + shard] = np.asarray(values[begin : begin + shard])


def local_files(folder: str) -> list[str]:
    """Every file under a folder, relative, sorted (so uploads and manifests are deterministic)."""
    out = []
    for root, _, files in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, f), folder) for f in files]
    return sorted(p.replace(os.sep, "/") for p in out)


def group_checksum(files: dict[str, dict[str, Any]], prefix: str) -> str:
    """One sha256 over the (name, sha256) of a group's files."""
    h = hashlib.sha256()
    for name in sorted(files):
        if name.startswith(prefix):
            h.update(f"{name[len(prefix):]}\0{files[name]['sha256']}\n".encode())
    return h.hexdigest()
