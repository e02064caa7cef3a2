"""End to end on SeaweedFS, and every bad input as one clear error with nothing half-written."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from paths.errors import ConfigurationError, DataError, NotFound
from sharding.dataset import PathDataset, read_documents
from sharding.shard import ShardOptions, shard
from tests.sharding.conftest import docs, make_run, write_jsonl


@pytest.mark.s3
def test_shard_and_read_on_seaweedfs(seaweed, bucket, tokenizer_dir, tmp_path):
    import fsspec

    options = seaweed.storage_options
    run = make_run(f"s3://{bucket}/shard-{tmp_path.name}", tokenizer_dir, 2, options)
    local = write_jsonl(str(tmp_path / "a.jsonl"), docs(100))
    fs = fsspec.filesystem("s3", **options)
    fs.pipe(f"{bucket}/inputs-{tmp_path.name}/b.jsonl", "".join(json.dumps(d) + "\n" for d in docs(100, 100)).encode())
    manifest = shard(run, ShardOptions(dataset="d", inputs=[local, f"s3://{bucket}/inputs-{tmp_path.name}/*.jsonl"], router="moe", chunk_tokens=256, shard_tokens=1024), storage_options=options)
    assert manifest["documents"] == 200 and [i["docs"] for i in manifest["inputs"]] == [100, 100]
    path = max(manifest["paths"], key=lambda p: manifest["paths"][p]["train_tokens"])
    stream = np.concatenate(read_documents(run, "d", path))
    seen = []
    loader = torch.utils.data.DataLoader(PathDataset(run, "d", path, 16, epochs=1, batch_size=2), batch_size=2, num_workers=2)
    for batch in loader:
        for tokens, valid, index in zip(batch["tokens"], batch["valid"], batch["index"]):
            s = int(index) * 16
            assert np.array_equal(tokens[: int(valid)].numpy(), stream[s : s + 17])
            seen.append(int(index))
    assert sorted(seen) == list(range(-(-(len(stream) - 1) // 16)))
    from storage.admin import verify

    assert verify(run).ok


def shard_cli(*args: str):
    result = CliRunner().invoke(main, ["shard", *args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    for f in fragments:
        assert f in err, err


@pytest.fixture
def run_url(run2) -> str:
    return run2.url


def nothing_written(run_url: str) -> bool:
    data = os.path.join(run_url, "data", "d")
    return not os.path.exists(os.path.join(data, "manifest.json"))


def test_malformed_json_line_names_file_and_line(run_url, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": "broken\n' + json.dumps({"text": "ok"}) + "\n")
    code, _, err = shard_cli(run_url, "--dataset", "d", "--input", str(f))
    one_line_error(code, err, f"{f}:2", "--on-error skip")
    assert nothing_written(run_url)
    code, out, err = shard_cli(run_url, "--dataset", "d", "--input", str(f), "--on-error", "skip")
    assert code == 0, err
    assert "2 documents" in out and "malformed 1" in out


def test_missing_text_field(run_url, tmp_path):
    f = write_jsonl(str(tmp_path / "x.jsonl"), [{"body": "no text here"}])
    code, _, err = shard_cli(run_url, "--dataset", "d", "--input", f)
    one_line_error(code, err, f"{f}:1", "'text'", "body", "--text-field")
    assert nothing_written(run_url)


def test_non_utf8_bytes(run_url, tmp_path):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    code, _, err = shard_cli(run_url, "--dataset", "d", "--input", str(f))
    one_line_error(code, err, f"{f}:2", "not UTF-8")
    assert nothing_written(run_url)


def test_empty_documents_are_skipped_and_counted(run2, tmp_path):
    f = write_jsonl(str(tmp_path / "e.jsonl"), [{"text": "a doc"}, {"text": ""}, {"text": "   \n"}, {"text": "another"}])
    manifest = shard(run2, ShardOptions(dataset="d", inputs=[f]))
    assert manifest["documents"] == 2 and manifest["inputs"][0]["skipped"]["empty"] == 2


def test_pattern_that_matches_nothing(run_url, tmp_path):
    code, _, err = shard_cli(run_url, "--dataset", "d", "--input", str(tmp_path / "none-*.jsonl"))
    one_line_error(code, err, "none-*.jsonl", "matches no file")


def test_unknown_router(run_url, tmp_path, run2):
    f = write_jsonl(str(tmp_path / "a.jsonl"), docs(5))
    result = CliRunner().invoke(main, ["shard", run_url, "--dataset", "d", "--input", f, "--router", "magic"])
    assert result.exit_code == 2 and "magic" in result.stderr
    with pytest.raises(ConfigurationError, match="unknown router 'magic'"):
        ShardOptions(dataset="d", inputs=[f], router="magic")


def test_prefix_longer_than_the_context(run_url, tmp_path):
    f = write_jsonl(str(tmp_path / "a.jsonl"), docs(5))
    code, _, err = shard_cli(run_url, "--dataset", "d", "--input", f, "--router", "moe", "--prefix-tokens", "100000")
    one_line_error(code, err, "--prefix-tokens 100000", "context")
    assert nothing_written(run_url)


def test_other_options_are_refused_unless_overwrite(run_url, tmp_path):
    f = write_jsonl(str(tmp_path / "a.jsonl"), docs(30))
    assert shard_cli(run_url, "--dataset", "d", "--input", f)[0] == 0
    code, out, err = shard_cli(run_url, "--dataset", "d", "--input", f)  # same options: nothing to do
    assert code == 0 and "30 documents" in out
    code, _, err = shard_cli(run_url, "--dataset", "d", "--input", f, "--holdout", "0.5")
    one_line_error(code, err, "already exists", "holdout", "--overwrite")
    code, out, err = shard_cli(run_url, "--dataset", "d", "--input", f, "--holdout", "0.5", "--overwrite")
    assert code == 0, err


def test_domain_errors(run2, tmp_path):
    f = write_jsonl(str(tmp_path / "a.jsonl"), docs(9))
    with pytest.raises(ConfigurationError, match="--domain-field"):
        ShardOptions(dataset="d", inputs=[f], router="domain")
    with pytest.raises(ConfigurationError, match="--domain-map"):  # two levels need a map
        shard(run2, ShardOptions(dataset="d", inputs=[f], router="domain", domain_field="domain"))
    (tmp_path / "m.json").write_text(json.dumps({"code": "p00-00"}))
    with pytest.raises(DataError, match="'math'.*--domain-map"):
        shard(run2, ShardOptions(dataset="d2", inputs=[f], router="domain", domain_field="domain", domain_map=str(tmp_path / "m.json")))
    (tmp_path / "m2.json").write_text(json.dumps({"code": "p09-09"}))
    with pytest.raises(ConfigurationError, match="p09-09"):
        shard(run2, ShardOptions(dataset="d3", inputs=[f], router="domain", domain_field="domain", domain_map=str(tmp_path / "m2.json")))


def test_reader_errors(run2):
    with pytest.raises(NotFound, match="paths shard"):
        PathDataset(run2, "nope", "p00-00", 8)


def test_route_cli_writes_jsonl(run_url, tmp_path):
    f = write_jsonl(str(tmp_path / "a.jsonl"), docs(20))
    assert shard_cli(run_url, "--dataset", "d", "--input", f, "--id-field", "id")[0] == 0
    out = tmp_path / "routed.jsonl"
    result = CliRunner().invoke(main, ["route", run_url, "--router", "d", "--input", f, "--id-field", "id", "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in lines] == [d["id"] for d in docs(20)] and all(x["path"].startswith("p") for x in lines)
    result = CliRunner().invoke(main, ["route", run_url, "--router", "missing", "--input", f])
    assert result.exit_code == 1 and "no router 'missing'" in result.stderr
