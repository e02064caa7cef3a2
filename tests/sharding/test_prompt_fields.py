"""`--kind prompts` keeps every other field of a record for the rewards: per record, in both
splits, from JSONL and Parquet; reserved names never override prompt / answer / ids; shards
written before the fields existed still read."""

from __future__ import annotations

import datetime

import pytest

from sharding import shard as shard_mod
from sharding.dataset import dataset_manifest, read_prompts
from sharding.shard import ShardOptions, shard
from tests.sharding.conftest import make_run, write_jsonl


@pytest.fixture
def run1(tmp_path, tokenizer_dir):
    """4 paths: 1 level x 4 experts."""
    return make_run(str(tmp_path / "run"), tokenizer_dir, 1)


def rows(n: int = 60) -> list[dict]:
    return [
        {"uid": 1000 + i, "prompt": f"What is {i} + {i}?", "answer": str(2 * i), "level": 1 + i % 3,
         "family": ["add", "mul"][i % 2], "meta": {"src": "gen", "tags": ["ä", str(i)]}, "ok": i % 2 == 0, "none": None}
        for i in range(n)
    ]


def records(run, dataset: str) -> dict[str, list[dict]]:
    """Every record of the dataset by split."""
    paths = dataset_manifest(run, dataset)["paths"]
    return {split: [r for p in paths for r in read_prompts(run, dataset, p, split)] for split in ("train", "heldout")}


def expected(row: dict) -> dict:
    """What read_prompts gives for an input row sharded with --id-field uid (ids aside)."""
    return {**{k: v for k, v in row.items() if k != "prompt"}, "id": str(row["uid"])}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_every_field_of_a_record_reaches_read_prompts(run1, tmp_path, fmt):
    data = rows()
    if fmt == "jsonl":
        f = write_jsonl(str(tmp_path / "p.jsonl"), data)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        f = str(tmp_path / "p.parquet")
        pq.write_table(pa.Table.from_pylist(data), f)
    manifest = shard(run1, ShardOptions(dataset="rl", inputs=[f], kind="prompts", text_field="prompt", id_field="uid", holdout=0.3))
    got = records(run1, "rl")
    assert got["train"] and got["heldout"]
    by_prompt = {r["prompt"]: r for r in data}
    for r in got["train"] + got["heldout"]:
        assert list(r)[:3] == ["prompt", "answer", "ids"] and r["ids"]
        assert {k: v for k, v in r.items() if k not in ("prompt", "ids")} == expected(by_prompt[r["prompt"]])
    assert len(got["train"]) + len(got["heldout"]) == len(data)
    for p in manifest["paths"]:  # in the manifest, so sized, hashed and in the group checksum like the rest
        assert {f"{p}.zarr/{a}/zarr.json" for a in ("fields_utf8", "fields_offsets", "heldout_fields_utf8")} <= set(manifest["files"])


def test_reserved_names_never_override_prompt_answer_or_ids(run1, tmp_path):
    data = [{"question": f"q{i}?", "answer": str(i), "prompt": "not me", "ids": [0], "family": "sub"} for i in range(20)]
    f = write_jsonl(str(tmp_path / "p.jsonl"), data)
    shard(run1, ShardOptions(dataset="rl", inputs=[f], kind="prompts", text_field="question", holdout=0.0))
    got = records(run1, "rl")["train"]
    assert sorted(r["prompt"] for r in got) == sorted(r["question"] for r in data)
    assert all(set(r) == {"prompt", "answer", "ids", "family"} and r["ids"] != [0] and r["family"] == "sub" for r in got)


def test_a_shard_without_fields_reads_as_before(run1, tmp_path, monkeypatch):
    f = write_jsonl(str(tmp_path / "p.jsonl"), rows(30))
    monkeypatch.setattr(shard_mod, "FIELDS_PROMPTS", ("tokens", "prompt", "answer"))  # the writer before fields
    manifest = shard(run1, ShardOptions(dataset="old", inputs=[f], kind="prompts", text_field="prompt", holdout=0.2))
    assert not any("fields_" in n for n in manifest["files"])
    got = records(run1, "old")
    assert sum(map(len, got.values())) == 30
    assert all(set(r) == {"prompt", "answer", "ids"} for r in got["train"] + got["heldout"])


def test_a_value_json_has_no_type_for_travels_as_text(run1, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = str(tmp_path / "p.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "answer": "1", "when": datetime.datetime(2024, 1, 1)}]), f)
    manifest = shard(run1, ShardOptions(dataset="dated", inputs=[f], kind="prompts", text_field="prompt", holdout=0.0))
    path = next(p for p, e in manifest["paths"].items() if e["train_docs"])
    assert read_prompts(run1, "dated", path)[0]["when"] == "2024-01-01T00:00:00"
