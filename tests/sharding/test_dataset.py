"""PathDataset: every token once per epoch across workers and ranks, exact mid-epoch resume,
shuffling by seed and epoch, and a reader that rejects a corrupt shard."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from sharding.dataset import PathDataset, read_documents
from sharding.shard import ShardOptions, shard


@pytest.fixture
def dataset(run2, corpus):
    """A sharded dataset with small chunks (so blocks, shards and prefetching all matter)."""
    manifest = shard(run2, ShardOptions(dataset="d", inputs=corpus, holdout=0.0, chunk_tokens=512, shard_tokens=2048))
    path = max(manifest["paths"], key=lambda p: manifest["paths"][p]["train_tokens"])
    return run2, path


def stream_of(run, path) -> np.ndarray:
    return np.concatenate(read_documents(run, "d", path))


def window_starts(batches, stream: np.ndarray, seq_len: int) -> list[int]:
    """The start offset of each window, checking its tokens against the stream there."""
    starts = []
    for batch in batches:
        for tokens, valid, index in zip(batch["tokens"], batch["valid"], batch["index"]):
            s = int(index) * seq_len
            expected = stream[s : s + seq_len + 1]
            assert int(valid) == len(expected) and np.array_equal(tokens[: int(valid)].numpy(), expected)
            assert (tokens[int(valid):] == 0).all()
            starts.append(s)
    return starts


def test_every_token_once_across_two_workers_and_two_ranks(dataset):
    run, path = dataset
    seq_len = 16
    stream = stream_of(run, path)
    starts = []
    for rank in range(2):
        ds = PathDataset(run, "d", path, seq_len, epochs=1, rank=rank, world_size=2, batch_size=4, seed=3)
        loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
        starts += window_starts(loader, stream, seq_len)
    assert sorted(starts) == list(range(0, len(stream) - 1, seq_len))  # each window once, none missed
    # targets = window[1:valid] cover tokens 1..T-1 exactly once
    assert sum(min(seq_len, len(stream) - 1 - s) for s in starts) == len(stream) - 1


def test_workers_do_not_change_the_order(dataset):
    run, path = dataset
    one = [b["tokens"] for b in torch.utils.data.DataLoader(PathDataset(run, "d", path, 8, epochs=1, batch_size=3), batch_size=3)]
    two = [b["tokens"] for b in torch.utils.data.DataLoader(PathDataset(run, "d", path, 8, epochs=1, batch_size=3), batch_size=3, num_workers=2)]
    assert len(one) == len(two) and all(torch.equal(a, b) for a, b in zip(one, two))


def test_resume_mid_epoch_is_exact(dataset):
    run, path = dataset
    full = [s["tokens"] for s in PathDataset(run, "d", path, 8, epochs=2, seed=5)]
    ds = PathDataset(run, "d", path, 8, epochs=2, seed=5)
    it = iter(ds)
    head = [next(it)["tokens"] for _ in range(len(full) // 2 + 3)]  # past the epoch boundary
    state = ds.state_dict()
    resumed = PathDataset(run, "d", path, 8, epochs=2, seed=5)
    resumed.load_state_dict(state)
    tail = [s["tokens"] for s in resumed]
    assert len(head) + len(tail) == len(full)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, full))
    with pytest.raises(Exception, match="seed"):
        PathDataset(run, "d", path, 8, seed=6).load_state_dict(state)


def test_shuffle_depends_on_seed_and_epoch(dataset):
    run, path = dataset
    ds = PathDataset(run, "d", path, 8)
    assert not np.array_equal(ds.epoch_order(0), ds.epoch_order(1))
    assert np.array_equal(ds.epoch_order(0), PathDataset(run, "d", path, 8).epoch_order(0))
    assert sorted(ds.epoch_order(0)) == list(range(ds.num_windows))


def test_an_epoch_shuffles_windows_of_several_chunks_together(run2, corpus):
    """A shard written input by input holds one domain's documents chunk after chunk: no stretch
    of an epoch may read one chunk alone (a curriculum by input), yet each window comes once."""
    from sharding.dataset import MIX

    manifest = shard(run2, ShardOptions(dataset="e", inputs=corpus, holdout=0.0, chunk_tokens=128, shard_tokens=1024))
    path = max(manifest["paths"], key=lambda p: manifest["paths"][p]["train_tokens"])
    ds = PathDataset(run2, "e", path, 8)  # 16 windows a chunk
    blocks = -(-ds.num_windows // ds.block)
    assert blocks > MIX  # more than one group: both the mixing and the grouping are exercised
    order = ds.epoch_order(0)
    assert sorted(order) == list(range(ds.num_windows))
    first = {int(w) // ds.block for w in order[: ds.block]}
    assert len(first) >= MIX // 2  # a chunk's worth of windows comes from several chunks
    group = {int(w) // ds.block for w in order[: MIX * ds.block]}
    assert len(group) == MIX  # and a group's windows from exactly MIX of them (read once each)
    stream = np.concatenate(read_documents(run2, "e", path))
    loader = torch.utils.data.DataLoader(PathDataset(run2, "e", path, 8, epochs=1, batch_size=4), batch_size=4, num_workers=2)
    starts = window_starts(loader, stream, 8)
    assert starts == [int(w) * 8 for w in order] and sorted(starts) == list(range(0, len(stream) - 1, 8))
    old = PathDataset(run2, "e", path, 8)
    old.load_state_dict({**{k: v for k, v in ds.state_dict().items() if k != "order"}, "position": 0})  # saved before the order had a version
    first = old.epoch_order(0)
    assert len({int(w) // ds.block for w in first[: ds.block]}) == 1 and sorted(first) == list(range(ds.num_windows))  # resumes in the order it was saved in


def test_corrupt_chunk_is_rejected(dataset):
    run, path = dataset
    chunk = next(o for o in run.store.list(f"data/d/{path}.zarr/tokens/c") if o.size > 100)
    data = bytearray(run.store.read(chunk.key))
    data[len(data) // 3] ^= 0xFF
    with open(run.store.path(chunk.key), "wb") as f:  # same size: only the checksums can tell
        f.write(bytes(data))
    with pytest.raises(Exception):
        list(PathDataset(run, "d", path, 8, epochs=1))
    os.remove(run.store.path(chunk.key))
    with pytest.raises(Exception, match="missing"):
        PathDataset(run, "d", path, 8, epochs=1).__iter__().__next__()


def test_a_corrupt_chunk_met_while_training_is_one_line_naming_the_shard(dataset, tmp_path):
    from click.testing import CliRunner

    from cli.main import main
    from paths.errors import IntegrityError
    from sharding.dataset import read_tokens

    run, path = dataset
    for chunk in [o for o in run.store.list(f"data/d/{path}.zarr/tokens/c") if o.size > 100]:  # wherever training starts
        data = bytearray(run.store.read(chunk.key))
        data[len(data) // 3] ^= 0xFF
        with open(run.store.path(chunk.key), "wb") as f:
            f.write(bytes(data))
    with pytest.raises(IntegrityError, match=rf"data/d/{path}.zarr: a chunk does not decode .*paths shard \.\.\. --overwrite"):
        read_tokens(run, "d", path)
    assert CliRunner().invoke(main, ["claim", run.url, "--path", path], env={"PATHS_HOME": str(tmp_path)}).exit_code == 0
    result = CliRunner().invoke(main, ["train", run.url, "--dataset", "d", "--steps", "2", "--set", "seq_len=8", "--no-progress"], env={"PATHS_HOME": str(tmp_path)})
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and f"{path}.zarr: a chunk does not decode" in lines[0], result.output
