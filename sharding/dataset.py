"""Reading a path's shard: packed training sequences (`PathDataset`), documents and prompts.

`PathDataset` cuts the path's token stream (documents concatenated, each ending in EOS) into
windows of `seq_len + 1` tokens that overlap by one token (inputs = window[:-1], targets =
window[1:]), so every token is a target exactly once per epoch; the last window is padded and says
how many of its tokens are real (`valid`).

Order and split. Windows are grouped in blocks of about one zarr chunk. Each epoch permutes the
blocks, takes them MIX at a time and permutes the windows of those MIX blocks together (seeded by
seed and epoch), giving one global sequence: a shard of up to MIX chunks (8M tokens) is shuffled
whole, and a larger one never reads one chunk's documents in a row (a shard written input by input,
one domain after another, is not read as a curriculum); rank r of W takes every W-th window of it, and its DataLoader workers take whole batches of that in
turn, so a DataLoader's output equals the rank's sequence whatever the number of workers. A
position (windows the rank has consumed) is all the state there is: `state_dict()` /
`load_state_dict()` resume mid-epoch exactly. The blocks of the next groups are read ahead by a
small thread pool (`prefetch` groups), which hides object-store latency; memory holds about
(prefetch + 1) x MIX chunks (4 MiB each).
"""

from __future__ import annotations

import json
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, TypeVar

import numpy as np
import torch

from paths.errors import ConfigurationError, IntegrityError, NotFound, PathsError
from sharding.writer import array_names
from storage.layout import Run, open_run

MIX = 8  # blocks (about a zarr chunk each) whose windows an epoch shuffles together
ORDER = 2  # the epoch order's version, saved with every position (1: each block's windows in a row)
from storage.manifest import read_manifest

T = TypeVar("T")


def dataset_manifest(run: Run, dataset: str) -> dict[str, Any]:
    """data/<dataset>/manifest.json, or a clear error if the dataset was never (fully) written."""
    try:
        return read_manifest(run.store, run.dataset(dataset))
    except NotFound:
        raise NotFound(f"dataset {dataset!r} is not in {run.url} (no data/{dataset}/manifest.json): run `paths shard {run.url} --dataset {dataset} --input ...`") from None


def path_entry(run: Run, dataset: str, path_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, the path's entry)."""
    manifest = dataset_manifest(run, dataset)
    entry = manifest.get("paths", {}).get(path_id)
    if entry is None:
        raise NotFound(f"dataset {dataset!r} has no path {path_id} (it has {', '.join(sorted(manifest.get('paths', {}))[:6])}...): pick one of those")
    return manifest, entry


def open_group(run: Run, dataset: str, path_id: str, manifest: dict[str, Any]):
    """The path's zarr group (read-only), after checking its files' sizes against the manifest."""
    import zarr

    from sharding.zarr_store import open_zarr_store

    key = run.shard(dataset, path_id)
    listed = {n: e for n, e in manifest["files"].items() if n.startswith(f"{path_id}.zarr/")}
    found = {o.key: o.size for o in run.store.list(key)}
    prefix = run.dataset(dataset) + "/"
    for name, e in listed.items():
        size = found.get(prefix + name)
        if size != e["bytes"]:
            what = "is missing" if size is None else f"has {size} bytes, the manifest says {e['bytes']}"
            raise IntegrityError(f"{run.store.url_of(prefix + name)} {what}: re-run `paths shard ... --overwrite` or restore it")
    return zarr.open_group(open_zarr_store(run, key, read_only=True), mode="r")


def decoded(run: Run, dataset: str, path_id: str, read: Callable[[], T]) -> T:
    """Run a read of a shard's arrays; a chunk that does not decode (corrupt bytes of the right
    size, which the size check lets through) becomes one line naming the shard and the fix."""
    try:
        return read()
    except PathsError:
        raise
    except (RuntimeError, ValueError, TypeError, OSError) as exc:
        if isinstance(exc, (FileNotFoundError, ConnectionError, TimeoutError)):
            raise
        where = run.store.url_of(run.shard(dataset, path_id))
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise IntegrityError(
            f"{where}: a chunk does not decode ({detail}): the shard is corrupt; find it with `paths storage verify {run.url}`, "
            "then restore it or re-run `paths shard ... --overwrite`"
        ) from None


def read_documents(run: Run, dataset: str, path_id: str, split: str = "train") -> list[np.ndarray]:
    """Every document of a path's split as token arrays (EOS included)."""
    manifest, _ = path_entry(run, dataset, path_id)
    group = open_group(run, dataset, path_id, manifest)
    vname, oname = array_names("tokens", split)
    tokens, offsets = decoded(run, dataset, path_id, lambda: (group[vname][:], group[oname][:]))
    return [tokens[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def read_tokens(run: Run, dataset: str, path_id: str, split: str = "train", limit: int | None = None) -> np.ndarray:
    """A path's token stream (documents concatenated), only its first `limit` tokens read."""
    manifest, _ = path_entry(run, dataset, path_id)
    tokens = open_group(run, dataset, path_id, manifest)[array_names("tokens", split)[0]]
    return decoded(run, dataset, path_id, lambda: np.asarray(tokens[: tokens.shape[0] if limit is None else limit]))


RESERVED = ("prompt", "answer", "ids")


def read_prompts(run: Run, dataset: str, path_id: str, split: str = "train") -> list[dict[str, Any]]:
    """A prompt dataset's records of one path: {"prompt", "answer", "ids" (prompt tokens), **the
    record's other fields} (what a reward gets as keyword arguments); a field named like one of the
    first three stays in the shard but is left out here. Shards older than format 2 have no fields."""
    manifest, _ = path_entry(run, dataset, path_id)
    if manifest.get("data_kind") != "prompts":
        raise ConfigurationError(f"dataset {dataset!r} holds documents, not prompts: shard it with --kind prompts")
    group = open_group(run, dataset, path_id, manifest)
    names = ("prompt", "answer", "tokens") + (("fields",) if array_names("fields", split)[0] in group else ())
    out: dict[str, list] = {}
    for name in names:
        vname, oname = array_names(name, split)
        values, offsets = decoded(run, dataset, path_id, lambda: (group[vname][:], group[oname][:]))
        pieces = [values[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
        out[name] = [p.tobytes().decode() for p in pieces] if name != "tokens" else [p.tolist() for p in pieces]
    extras = [json.loads(f) if f else {} for f in out["fields"]] if "fields" in out else [{}] * len(out["prompt"])
    return [
        {"prompt": p, "answer": a, "ids": t, **{k: v for k, v in e.items() if k not in RESERVED}}
        for p, a, t, e in zip(out["prompt"], out["answer"], out["tokens"], extras)
    ]


class PathDataset(torch.utils.data.IterableDataset):
    """Packed windows of `seq_len + 1` tokens of one path's shard, local or on S3."""

    def __init__(
        self,
        run: Run | str,
        dataset: str,
        path_id: str,
        seq_len: int,
        *,
        split: str = "train",
        seed: int = 0,
        shuffle: bool = True,
        batch_size: int = 1,
        epochs: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        prefetch: int = 2,
        pad_id: int = 0,
        storage_options: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.run = open_run(run, storage_options) if isinstance(run, str) else run
        manifest, entry = path_entry(self.run, dataset, path_id)
        if seq_len < 1 or batch_size < 1:
            raise ConfigurationError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
        if split not in ("train", "heldout"):
            raise ConfigurationError(f"split must be 'train' or 'heldout', got {split!r}")
        if rank is None or world_size is None:
            dist = torch.distributed.is_available() and torch.distributed.is_initialized()
            rank = torch.distributed.get_rank() if dist else 0
            world_size = torch.distributed.get_world_size() if dist else 1
        if not 0 <= rank < world_size:
            raise ConfigurationError(f"rank {rank} is outside a world of {world_size}")
        self.dataset, self.path_id, self.seq_len, self.split = dataset, path_id, seq_len, split
        self.seed, self.shuffle, self.batch_size, self.epochs = seed, shuffle, batch_size, epochs
        self.rank, self.world_size, self.prefetch, self.pad_id = rank, world_size, max(1, prefetch), pad_id
        self._manifest = manifest
        self.num_tokens = int(entry[f"{split}_tokens"])
        self.num_windows = max(0, -(-(self.num_tokens - 1) // seq_len))
        chunk = int(manifest["fingerprint"]["options"]["chunk_tokens"])
        self.block = max(1, chunk // seq_len)  # windows per block: about one chunk of tokens
        self.position = 0  # windows of this rank consumed (updated when iterated in-process)
        self.order = ORDER
        self._group = None

    # -- the order -----------------------------------------------------------------------------
    def rank_windows(self) -> int:
        """Windows this rank sees per epoch."""
        return max(0, -(-(self.num_windows - self.rank) // self.world_size))

    def epoch_order(self, epoch: int) -> np.ndarray:
        """This rank's window ids for one epoch, in order."""
        return self._epoch(epoch)[0]

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(this rank's window ids for one epoch, the group each is read in: its block, or with
        shuffling, its MIX blocks)."""
        n = self.num_windows
        if not self.shuffle or n == 0:
            order = np.arange(n)
            return order[self.rank :: self.world_size], (order // self.block)[self.rank :: self.world_size]
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
        blocks = rng.permutation(-(-n // self.block))
        if self.block == 1:  # records, not token windows: one permutation of them all
            order, groups = blocks, blocks
        elif self.order == 1:  # the first order: each block's windows in a row
            order = np.concatenate([b * self.block + rng.permutation(min(self.block, n - b * self.block)) for b in blocks])
            groups = order // self.block
        else:
            parts = [np.concatenate([b * self.block + np.arange(min(self.block, n - b * self.block)) for b in blocks[i : i + MIX]]) for i in range(0, len(blocks), MIX)]
            order = np.concatenate([part[rng.permutation(len(part))] for part in parts])
            groups = np.concatenate([np.full(len(part), g) for g, part in enumerate(parts)])
        return order[self.rank :: self.world_size], groups[self.rank :: self.world_size]

    def positions(self, worker: int, workers: int) -> Iterator[tuple[int, int, tuple[int, int]]]:
        """(position, window id, (epoch, the group it is read in)) of this worker's share, from
        the current position on."""
        per_epoch = self.rank_windows()
        if per_epoch == 0:
            return
        end = None if self.epochs is None else self.epochs * per_epoch
        start, b = self.position, self.batch_size
        epoch, order, groups = -1, None, None
        own = type(self).epoch_order is not PathDataset.epoch_order  # a subclass that orders its records itself
        j = worker
        while True:
            for q in range(start + j * b, start + (j + 1) * b):
                if end is not None and q >= end:
                    return
                e, i = divmod(q, per_epoch)
                if e != epoch:
                    epoch = e
                    order, groups = self._epoch(e)
                    if own:
                        order = self.epoch_order(e)
                        groups = order // self.block
                yield q, int(order[i]), (e, int(groups[i]))
            j += workers

    # -- reading -------------------------------------------------------------------------------
    def _tokens(self):
        if self._group is None:
            self._group = open_group(self.run, self.dataset, self.path_id, self._manifest)
        return self._group[array_names("tokens", self.split)[0]]

    def _read_block(self, block: int) -> np.ndarray:
        first = block * self.block * self.seq_len
        last = min(((block + 1) * self.block) * self.seq_len + 1, self.num_tokens)
        return decoded(self.run, self.dataset, self.path_id, lambda: np.asarray(self._tokens()[first:last]))

    def window(self, block_tokens: np.ndarray, block: int, w: int) -> dict[str, torch.Tensor]:
        """Window w (tokens from w * seq_len on) cut from its block's tokens."""
        begin = (w - block * self.block) * self.seq_len
        piece = block_tokens[begin : begin + self.seq_len + 1].astype(np.int64)
        tokens = torch.full((self.seq_len + 1,), self.pad_id, dtype=torch.long)
        tokens[: len(piece)] = torch.from_numpy(piece)
        return {"tokens": tokens, "valid": torch.tensor(len(piece)), "index": torch.tensor(w)}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        self._group = None  # each worker process opens its own handles:
        if info is not None and self.run.store.protocol != "file":  # s3fs clients are not fork-safe
            self.run = open_run(self.run.url, self.run.store.options)
        spans = _spans(self.positions(worker, workers), self.block)
        pending: deque = deque()
        pool = ThreadPoolExecutor(self.prefetch)
        try:
            for _ in range(self.prefetch):
                _submit(pool, spans, pending, self._read_block, self.block)
            while pending:
                items, reads = pending.popleft()
                _submit(pool, spans, pending, self._read_block, self.block)
                tokens = {b: f.result() for b, f in reads.items()}
                for q, w in items:
                    if info is None:
                        self.position = q + 1
                    b = w // self.block
                    yield self.window(tokens[b], b, w)
        finally:
            # Never join here: an endless iterator is left unfinished and closed by the garbage
            # collector, in whatever thread it runs, even inside another thread's start, where
            # joining the pool's threads deadlocks.
            pool.shutdown(wait=False, cancel_futures=True)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self, position: int | None = None) -> dict[str, Any]:
        """Where this rank is; with DataLoader workers pass the windows the trainer consumed."""
        return {
            "dataset": self.dataset, "path": self.path_id, "split": self.split, "seq_len": self.seq_len,
            "seed": self.seed, "shuffle": self.shuffle, "batch_size": self.batch_size,
            "rank": self.rank, "world_size": self.world_size, "windows": self.num_windows, "order": self.order,
            "position": self.position if position is None else int(position),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the order-defining settings must match."""
        for key in ("dataset", "path", "split", "seq_len", "seed", "shuffle", "world_size", "rank"):
            if state.get(key) != getattr(self, {"path": "path_id"}.get(key, key)):
                raise ConfigurationError(
                    f"saved data position has {key}={state.get(key)!r} but this dataset has {getattr(self, {'path': 'path_id'}.get(key, key))!r}: resume with the same settings"
                )
        self.order = int(state.get("order", 1))  # a position saved under the first order (blocks alone) resumes in it
        self.position = int(state["position"])


def _spans(positions: Iterator[tuple[int, int, Any]], block: int) -> Iterator[list[tuple[int, int]]]:
    """Consecutive positions read in the same group (one block, or MIX blocks shuffled together):
    [(position, window)], at most a group's windows."""
    current, items = None, []
    for q, w, group in positions:
        if items and (group != current or len(items) >= MIX * block):
            yield items
            items = []
        current = group
        items.append((q, w))
    if items:
        yield items


def _submit(pool: ThreadPoolExecutor, spans: Any, pending: deque, read: Callable[[int], Any], block: int) -> None:
    """Start reading the blocks of the next span, each once."""
    items = next(spans, None)
    if items is not None:
        pending.append((items, {b: pool.submit(read, b) for b in dict.fromkeys(w // block for _, w in items)}))
