"""`paths shard`: documents come back exactly, routing is per document, writing is deterministic
and resumable, balancing respects the capacity, and the router is saved and reused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paths.models import run_tokenizer
from sharding import shard as shard_mod
from sharding.dataset import dataset_manifest, read_documents, read_prompts
from sharding.shard import ShardOptions, shard
from tests.sharding.conftest import docs, make_run, write_jsonl


def all_documents(run, dataset: str) -> dict[str, list[np.ndarray]]:
    manifest = dataset_manifest(run, dataset)
    return {p: read_documents(run, dataset, p) + read_documents(run, dataset, p, "heldout") for p in manifest["paths"]}


def test_tokens_decode_back_to_each_document(run2, corpus):
    manifest = shard(run2, ShardOptions(dataset="d", inputs=corpus, id_field="id", holdout=0.1))
    tok, _ = run_tokenizer(run2)
    texts = [json.loads(line)["text"] for f in corpus for line in open(f, encoding="utf-8")]
    decoded = []
    for path_docs in all_documents(run2, "d").values():
        for ids in path_docs:
            assert ids[-1] == tok.eos_token_id and ids.dtype == np.uint32
            decoded.append(tok.decode(ids[:-1].tolist()))
    assert sorted(decoded) == sorted(texts)  # every document exactly once, text unchanged
    assert manifest["documents"] == len(texts)
    assert sum(c["heldout_docs"] for c in manifest["paths"].values()) > 0


def test_same_inputs_give_identical_bytes(run2, corpus):
    opts = ShardOptions(dataset="d", inputs=corpus, id_field="id", router="moe", chunk_tokens=256, shard_tokens=1024)
    first = shard(run2, opts)
    run2.store.delete_prefix("data/d")
    run2.store.delete_prefix("router/d")
    second = shard(run2, opts)
    assert first["files"] == second["files"]  # every zarr object: same size, same sha256
    assert first["paths"] == second["paths"]


def test_resume_after_a_crash_continues_from_the_last_finished_input(run2, corpus, monkeypatch):
    opts = ShardOptions(dataset="d", inputs=corpus, id_field="id")
    reference = shard(run2, opts)
    run2.store.delete_prefix("data/d")
    real, staged = shard_mod.stage_file, []

    def crash_on_second(run, o, router, files, index, *args):
        if index == 1:
            raise KeyboardInterrupt("killed")
        staged.append(index)
        return real(run, o, router, files, index, *args)

    monkeypatch.setattr(shard_mod, "stage_file", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        shard(run2, opts)
    assert not run2.store.exists("data/d/manifest.json")  # nothing half-written is visible
    assert [o.key for o in run2.store.list("data/d") if o.key.endswith(".zarr/zarr.json")] == []

    def count(run, o, router, files, index, *args):
        staged.append(index)
        return real(run, o, router, files, index, *args)

    monkeypatch.setattr(shard_mod, "stage_file", count)
    resumed = shard(run2, opts)
    assert staged == [0, 1, 2]  # file 0 was not read again
    assert resumed["files"] == reference["files"]
    assert not run2.store.list("data/d/_staging")


def test_domain_router_sends_every_document_of_a_domain_to_its_path(run2, corpus, tmp_path):
    mapping = {"code": "p00-01", "math": "p02-03", "prose": "p03-00"}
    (tmp_path / "map.json").write_text(json.dumps(mapping))
    manifest = shard(run2, ShardOptions(dataset="d", inputs=corpus, id_field="id", router="domain", domain_field="domain", domain_map=str(tmp_path / "map.json")))
    tok, _ = run_tokenizer(run2)
    domain_of = {d["text"]: d["domain"] for d in docs(360)}
    for path, path_docs in all_documents(run2, "d").items():
        domains = {domain_of[tok.decode(ids[:-1].tolist())] for ids in path_docs}
        assert domains == ({d for d, p in mapping.items() if p == path}), path
    assert manifest["router"]["balanced"] is False


def test_domain_router_without_a_map_takes_one_expert_per_domain(tmp_path, tokenizer_dir, corpus):
    run = make_run(str(tmp_path / "run1"), tokenizer_dir, 1)
    manifest = shard(run, ShardOptions(dataset="d", inputs=corpus, router="domain", domain_field="domain"))
    counts = {p: c["train_docs"] + c["heldout_docs"] for p, c in manifest["paths"].items()}
    assert counts == {"p00": 120, "p01": 120, "p02": 120, "p03": 0}  # code, math, prose sorted
    router = json.loads(run.store.read("router/d/router.json"))
    assert router["options"]["domain_map"] == {"code": "p00", "math": "p01", "prose": "p02"}


@pytest.mark.parametrize("router", ["hash", "moe", "kmeans"])
def test_balanced_assignment_respects_capacity(run2, corpus, router):
    manifest = shard(run2, ShardOptions(dataset="d", inputs=corpus, router=router, slack=0.05))
    cap = manifest["capacity"]
    assert cap == int(np.ceil(1.05 * 360 / 16))
    counts = [c["train_docs"] + c["heldout_docs"] for c in manifest["paths"].values()]
    assert max(counts) <= cap and sum(counts) == 360


def test_balance_moves_the_least_decided_documents():
    from sharding.balance import assign

    prefs = np.array([[0, 1]] * 6, dtype=np.int32)
    scores = np.array([[0.0, -s] for s in (5, 4, 3, 2, 1, 0.5)], dtype=np.float32)  # margins shrink
    out = assign(prefs, scores, 2, slack=0.0)
    assert out.tolist() == [0, 0, 0, 1, 1, 1]
    assert assign(prefs, scores, 2, slack=None).tolist() == [0] * 6


def test_saved_router_routes_new_documents_the_same_way(run2, corpus, tmp_path):
    import io

    from sharding.route import route
    from sharding.inputs import Fields

    shard(run2, ShardOptions(dataset="d", inputs=corpus, id_field="id", router="kmeans", balance=False, holdout=0.0))
    tok, _ = run_tokenizer(run2)
    where = {}
    for path, path_docs in all_documents(run2, "d").items():
        for ids in path_docs:
            where[tok.decode(ids[:-1].tolist())] = path
    out = io.StringIO()
    route(run2, "d", corpus, out, fields=Fields(id="id"))
    routed = {json.loads(line)["id"]: json.loads(line)["path"] for line in out.getvalue().splitlines()}
    expected = {d["id"]: where[d["text"]] for d in docs(360)}
    assert routed == expected


def test_kmeans_recovers_separated_clusters():
    import torch

    from sharding.kmeans import level_distances, product_kmeans

    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[10.0, 0, 0, 0], [-10, 0, 0, 0], [0, 0, 10, 0], [0, 0, -10, 0]])
    labels = torch.arange(400) % 4
    x = centres[labels] + 0.1 * torch.randn(400, 4, generator=g)
    c = product_kmeans(x, levels=1, k=4, seed=0)
    found = level_distances(x, c)[:, 0].argmin(1)
    # the same partition up to renaming the clusters
    pairs = {(int(a), int(b)) for a, b in zip(labels, found)}
    assert len(pairs) == 4


def test_prompts_keep_prompt_and_answer_per_path(run2, tmp_path):
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(50)]
    f = write_jsonl(str(tmp_path / "p.jsonl"), rows)
    manifest = shard(run2, ShardOptions(dataset="rl", inputs=[f], kind="prompts", text_field="prompt", holdout=0.0))
    got = [r for p in manifest["paths"] for r in read_prompts(run2, "rl", p)]
    assert sorted((r["prompt"], r["answer"]) for r in got) == sorted((r["prompt"], r["answer"]) for r in rows)
    tok, _ = run_tokenizer(run2)
    assert all(tok.decode(r["ids"]) == r["prompt"] for r in got)  # prompts carry no EOS


def test_parquet_text_gzip_and_zstd_inputs(run2, tmp_path):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rows = docs(30)
    pq.write_table(pa.Table.from_pylist(rows[:10]), str(tmp_path / "a.parquet"))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[10:20])
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress("".join(json.dumps(r) + "\n" for r in rows[20:29]).encode()))
    (tmp_path / "d.txt").write_text(rows[29]["text"], encoding="utf-8")
    manifest = shard(run2, ShardOptions(dataset="mix", inputs=[str(tmp_path / x) for x in ("a.parquet", "b.jsonl.gz", "c.jsonl.zst", "d.txt")]))
    assert [i["docs"] for i in manifest["inputs"]] == [10, 10, 9, 1]
    tok, _ = run_tokenizer(run2)
    decoded = sorted(tok.decode(ids[:-1].tolist()) for p in all_documents(run2, "mix").values() for ids in p)
    assert decoded == sorted(r["text"] for r in rows)


def test_limit_stops_after_n_documents(run2, corpus):
    manifest = shard(run2, ShardOptions(dataset="d", inputs=corpus, limit=150))
    assert manifest["documents"] == 150
    assert [i["docs"] for i in manifest["inputs"]] == [120, 30, 0]


def test_spilling_to_disk_gives_the_same_bytes(run2, corpus, monkeypatch):
    opts = ShardOptions(dataset="d", inputs=corpus, id_field="id", chunk_tokens=256, shard_tokens=1024)
    in_memory = shard(run2, opts)
    run2.store.delete_prefix("data/d")
    monkeypatch.setattr(shard_mod, "MEMORY_BUDGET", 1)  # spill after every append
    spilled = shard(run2, opts)
    assert spilled["files"] == in_memory["files"]


@pytest.mark.parametrize("n, chunk, shard", [(0, 4, 8), (1, 4, 8), (7, 4, 8), (10, 4, 8), (33, 4, 16), (40, 8, 8)])
def test_the_writer_writes_the_bytes_zarr_writes(tmp_path, n, chunk, shard):
    """Every object of a prompts group (metadata; uint32, uint64 and uint8 shards, their indexes)
    byte for byte as zarr's own array API writes it: arrays of one chunk, a padded last chunk, a
    last shard with chunks past the array's end, several shards."""
    import zarr
    from zarr.codecs import ZstdCodec

    from sharding.writer import FIELDS_PROMPTS, MemoryBudget, PathBuffer, _layout, array_names, write_groups
    from storage.url import open_store

    rng = np.random.default_rng(n)
    buffer = PathBuffer(str(tmp_path / "buf"), FIELDS_PROMPTS, MemoryBudget(1 << 30))
    for split, m in (("train", n), ("heldout", n // 3)):
        for name in FIELDS_PROMPTS:
            buffer.append(split, name, rng.integers(0, 250, m), np.array([m // 2, m - m // 2], np.int64))
    attributes = {"dataset": "d", "path": "p00", "kind": "prompts", "format_version": 2}
    store = open_store(str(tmp_path / "ours"), create=True)
    [(counts, files)] = write_groups(store, [("g.zarr", buffer, attributes)], chunk, shard)
    assert counts == {"train_docs": 2, "train_tokens": n, "heldout_docs": 2, "heldout_tokens": n // 3}

    theirs = zarr.storage.MemoryStore()
    group = zarr.open_group(store=theirs, mode="w", attributes=attributes)
    for split in ("train", "heldout"):
        for name in FIELDS_PROMPTS:
            for aname, array, c, s in zip(array_names(name, split), buffer.arrays(split, name), (chunk, max(1, chunk // 8)), (shard, shard // chunk * max(1, chunk // 8))):
                c, s = _layout(len(array), c, s)
                arr = group.create_array(aname, shape=array.shape, dtype=array.dtype, chunks=(c,), shards=(s,), compressors=ZstdCodec(level=3, checksum=True), fill_value=0, config={"write_empty_chunks": True})
                if len(array):
                    arr[:] = array
    expected = {k: v.to_bytes() for k, v in theirs._store_dict.items()}
    assert sorted(files) == sorted(expected)
    for key, data in expected.items():
        assert store.read(f"g.zarr/{key}") == data, key
        assert files[key]["bytes"] == len(data)
    assert np.array_equal(zarr.open_group(str(tmp_path / "ours" / "g.zarr"), mode="r")["prompt_utf8"][:], buffer.arrays("train", "prompt")[0])


def test_offsets_shards_hold_whole_chunks(run2, corpus):
    """shard_tokens a multiple of chunk_tokens whose eighths are not (60 and 20: 7 and 2) still
    writes: the offsets' shard is as many of their chunks as a values shard holds."""
    small = shard(run2, ShardOptions(dataset="small", inputs=corpus, id_field="id", chunk_tokens=20, shard_tokens=60))
    default = shard(run2, ShardOptions(dataset="default", inputs=corpus, id_field="id"))
    for p in small["paths"]:
        assert [d.tolist() for d in read_documents(run2, "small", p)] == [d.tolist() for d in read_documents(run2, "default", p)]


def test_a_fresh_process_shards(run2, corpus):
    """`paths shard` in a new interpreter: zarr is first imported by the writer, in its own thread
    before its pool starts (pool threads importing zarr at once can fail on zarr's circular
    imports: seen once in a fresh `paths shard`, a race no test can time)."""
    import subprocess
    import sys

    script = (
        "import sys, concurrent.futures as cf\n"
        "from sharding.shard import ShardOptions, shard\n"
        "from storage.layout import open_run\n"
        "assert 'zarr' not in sys.modules\n"
        "real = cf.ThreadPoolExecutor.__init__\n"
        "def init(self, *a, **k):\n"
        "    if sys._getframe(1).f_code.co_name == 'write_groups':\n"
        "        missing = [m for m in ('zarr.core.group', 'zarr.core.metadata.v3', 'numcodecs', 'google_crc32c') if m not in sys.modules]\n"
        "        assert not missing, f'the writer pool threads would import {missing} themselves'\n"
        "    real(self, *a, **k)\n"
        "cf.ThreadPoolExecutor.__init__ = init\n"
        "print(shard(open_run(sys.argv[1]), ShardOptions(dataset='fresh', inputs=sys.argv[2:]))['documents'])\n"
    )
    out = subprocess.run([sys.executable, "-c", script, run2.url, *corpus], capture_output=True, text=True, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == dataset_manifest(run2, "fresh")["documents"] > 0
