"""Sharding and reading a path's data, against the tokenizer alone and MosaicML streaming.

    .venv/bin/python bench/shard.py [--copies 3] [--seq-len 256] [--work bench/out/shard]

Corpus: the quickstart's local corpus (stdlib sources, pydoc topics, generated arithmetic),
repeated --copies times with distinct ids. Run: tiny-mixtral decomposed into 16 paths. Measured in
the same run:
1. `shard()` end to end (read JSONL, tokenize, hash-route, stage, balance, write 16 zarr groups,
   manifest) in tokens/s, against the tokenizer alone on the same texts (goal >= 0.75x);
2. our writing step (staged parts -> 16 zarr groups + manifest) against MosaicML streaming's
   `MDSWriter` writing the same token sequences to 16 path folders, zstd (goal >= 1x);
3. reading one epoch of shuffled windows of seq_len + 1 tokens: `PathDataset` against
   `StreamingDataset` over the same windows stored as MDS samples, from a local folder and from
   SeaweedFS (goal >= 1x).
Each ratio is printed; results are appended as JSON lines to bench/out/shard.jsonl.

MosaicML streaming 0.13 pins transformers<5 and numpy<2.2, so `make bench` installs it without
its dependencies (plus the few it imports); its top-level package imports torchvision for its
vision datasets, which cannot be installed beside the CPU torch here, so the bench imports
`streaming.base` (the writer and dataset, unchanged) without running `streaming/__init__.py`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import zarr  # noqa: E402,F401  (imported before timing, as streaming is)


def streaming_base():
    """MosaicML streaming's MDSWriter and StreamingDataset (see the module docstring)."""
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None:
            raise SystemExit("mosaicml-streaming is not installed: run `make bench` (it installs it)")
        pkg = types.ModuleType("streaming")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = pkg
    from streaming.base import MDSWriter, StreamingDataset

    return MDSWriter, StreamingDataset


def make_corpus(folder: str, copies: int) -> list[str]:
    from sharding.corpus import code_docs, math_docs, prose_docs

    os.makedirs(folder, exist_ok=True)
    docs = code_docs() + prose_docs() + math_docs()
    files = []
    for c in range(copies):
        path = os.path.join(folder, f"part{c}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({**d, "id": f"{d['id']}#{c}"}) + "\n")
        files.append(path)
    return files


def make_run(url: str, storage_options=None):
    from paths.prepare.init import init_run
    from paths.prepare.decompose import decompose
    from storage.layout import open_run

    init_run(url, preset="tiny-mixtral", seed=0, storage_options=storage_options)
    run = open_run(url, storage_options)
    decompose(run, 2)
    return run


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def bench_tokenizer(run, files) -> tuple[int, float]:
    from paths.models import run_tokenizer

    tok, _ = run_tokenizer(run)
    texts = [json.loads(line)["text"] for f in files for line in open(f, encoding="utf-8")]
    t = time.perf_counter()
    n = 0
    for i in range(0, len(texts), 1024):
        n += sum(len(x) + 1 for x in tok(texts[i : i + 1024], add_special_tokens=False)["input_ids"])
    return n, time.perf_counter() - t


def bench_shard(run, files, dataset: str):
    """(manifest, total seconds, seconds of the writing step)."""
    import sharding.shard as s

    real, spent = s._consolidate, {}

    def consolidate(*a, **k):
        out, spent["write"] = timed(lambda: real(*a, **k))
        return out

    s._consolidate = consolidate
    try:
        manifest, seconds = timed(lambda: s.shard(run, s.ShardOptions(dataset=dataset, inputs=files, id_field="id", router="hash")))
    finally:
        s._consolidate = real
    return manifest, seconds, spent["write"]


def bench_mds_write(run, dataset: str, manifest: dict, out: str) -> float:
    """MDSWriter writing every path's documents (the same token sequences, same order)."""
    from sharding.dataset import read_documents

    MDSWriter, _ = streaming_base()
    per_path = {p: read_documents(run, dataset, p) for p in manifest["paths"]}
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    for p, docs in per_path.items():
        with MDSWriter(out=os.path.join(out, p), columns={"tokens": "ndarray:uint32"}, compression="zstd", size_limit=1 << 26) as w:
            for d in docs:
                w.write({"tokens": d})
    return time.perf_counter() - t


def windows_mds(stream: np.ndarray, seq_len: int, out: str) -> int:
    """The same windows PathDataset yields, as MDS samples (LLM Foundry's pre-packed layout)."""
    MDSWriter, _ = streaming_base()
    shutil.rmtree(out, ignore_errors=True)
    n = -(-(len(stream) - 1) // seq_len)
    with MDSWriter(out=out, columns={"tokens": "ndarray:uint32"}, compression="zstd", size_limit=1 << 26) as w:
        for i in range(n):
            w.write({"tokens": stream[i * seq_len : i * seq_len + seq_len + 1]})
    return n


BATCH, WORKERS = 16, 2  # as a training loop reads: a DataLoader with worker processes


def read_ours(run, dataset: str, path: str, seq_len: int) -> tuple[int, float]:
    import torch

    from sharding.dataset import PathDataset

    t = time.perf_counter()
    ds = PathDataset(run, dataset, path, seq_len, epochs=1, seed=0, batch_size=BATCH)
    n = sum(len(b["tokens"]) for b in torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS))
    return n, time.perf_counter() - t


def _stack(samples: list[dict], width: int):
    """MDS samples are read-only uint32 views: pad and stack them as int64, as ours does."""
    import torch

    out = np.zeros((len(samples), width), dtype=np.int64)
    for i, s in enumerate(samples):
        out[i, : len(s["tokens"])] = s["tokens"]
    return torch.from_numpy(out)


def read_mds(seq_len: int, local: str, remote: str | None = None) -> tuple[int, float]:
    import torch

    _, StreamingDataset = streaming_base()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    t = time.perf_counter()
    ds = StreamingDataset(local=local, remote=remote, shuffle=True, shuffle_seed=0, batch_size=BATCH)
    n = 0
    for batch in torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=functools.partial(_stack, width=seq_len + 1)):
        n += len(batch)
    return n, time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "shard"))
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    files = make_corpus(os.path.join(args.work, "corpus"), args.copies)
    run = make_run(os.path.join(args.work, "run"))
    results: dict = {"copies": args.copies, "seq_len": args.seq_len, "cpus": os.cpu_count()}

    tok_tokens, tok_s = bench_tokenizer(run, files)
    manifest, shard_s, write_s = bench_shard(run, files, "bench")
    assert manifest["tokens"] == tok_tokens, (manifest["tokens"], tok_tokens)
    mds_s = bench_mds_write(run, "bench", manifest, os.path.join(args.work, "mds-paths"))
    results |= {
        "documents": manifest["documents"], "tokens": tok_tokens,
        "tokenizer_tok_s": tok_tokens / tok_s, "shard_tok_s": tok_tokens / shard_s,
        "shard_vs_tokenizer": tok_s / shard_s,
        "write_tok_s": tok_tokens / write_s, "mds_write_tok_s": tok_tokens / mds_s, "write_vs_mds": mds_s / write_s,
    }

    # Reading: all documents on one path (domain router, one map), so an epoch is long enough.
    mapping = os.path.join(args.work, "all-to-one.json")
    json.dump({"code": "p00-00", "math": "p00-00", "prose": "p00-00"}, open(mapping, "w"))
    from sharding.dataset import read_tokens
    from sharding.shard import ShardOptions, shard

    opts = ShardOptions(dataset="read", inputs=files, id_field="id", router="domain", domain_field="domain", domain_map=mapping, holdout=0.0)
    shard(run, opts)
    stream = read_tokens(run, "read", "p00-00")
    n_mds = windows_mds(stream, args.seq_len, os.path.join(args.work, "mds-read"))
    n_ours, ours_s = read_ours(run, "read", "p00-00", args.seq_len)
    n_theirs, theirs_s = read_mds(args.seq_len, os.path.join(args.work, "mds-read"))
    assert n_ours == n_theirs == n_mds, (n_ours, n_theirs, n_mds)
    results |= {"read_samples": n_ours, "read_local_ours_s": n_ours / ours_s, "read_local_mds_s": n_theirs / theirs_s, "read_local_ratio": theirs_s / ours_s}

    from storage.seaweed import start_seaweed

    os.makedirs(os.path.join(args.work, "seaweed"))
    with start_seaweed(os.path.join(args.work, "seaweed")) as server:
        for k, v in server.env().items():
            os.environ[k] = v
        os.environ["S3_ENDPOINT_URL"] = server.endpoint  # MosaicML streaming's endpoint variable
        s3run = make_run("s3://bench/run", server.storage_options)
        shard(s3run, opts)
        import fsspec

        fs = fsspec.filesystem("s3", **server.storage_options)
        fs.put(os.path.join(args.work, "mds-read"), "bench/mds-read", recursive=True)
        n_ours, ours_s = read_ours(s3run, "read", "p00-00", args.seq_len)
        cache = tempfile.mkdtemp(dir=args.work)
        n_theirs, theirs_s = read_mds(args.seq_len, cache, "s3://bench/mds-read")
        assert n_ours == n_theirs
        results |= {"read_s3_ours_s": n_ours / ours_s, "read_s3_mds_s": n_theirs / theirs_s, "read_s3_ratio": theirs_s / ours_s}

    print(f"corpus: {results['documents']:,} documents, {results['tokens']:,} tokens ({args.copies} copies); 16 paths; {os.cpu_count()} CPUs")
    print(f"shard end to end   {results['shard_tok_s']:>12,.0f} tok/s   tokenizer alone {results['tokenizer_tok_s']:>12,.0f} tok/s   ratio {results['shard_vs_tokenizer']:.2f} (goal >= 0.75)")
    print(f"writing step       {results['write_tok_s']:>12,.0f} tok/s   MDSWriter       {results['mds_write_tok_s']:>12,.0f} tok/s   ratio {results['write_vs_mds']:.2f} (goal >= 1)")
    print(f"read, local folder {results['read_local_ours_s']:>12,.0f} smp/s   StreamingDataset {results['read_local_mds_s']:>11,.0f} smp/s   ratio {results['read_local_ratio']:.2f} (goal >= 1)")
    print(f"read, SeaweedFS    {results['read_s3_ours_s']:>12,.0f} smp/s   StreamingDataset {results['read_s3_mds_s']:>11,.0f} smp/s   ratio {results['read_s3_ratio']:.2f} (goal >= 1)")
    print(f"({results['read_samples']:,} windows of {args.seq_len + 1} tokens, one epoch, shuffled)")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "shard.jsonl"), "a") as f:
        f.write(json.dumps({"at": time.time(), **results}) + "\n")


if __name__ == "__main__":
    main()
