"""Compose as plan, then execute: `--dry-run` prints the plan and writes nothing; a compose with
`--overwrite` that fails leaves the previous composed model byte-identical (local and S3); one
that succeeds replaces it whole (no file of the old one left behind)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from cli.main import main
from compose.merge import compose_moe
from compose.plan import plan_compose
from paths.errors import ConfigurationError, IntegrityError
from tests.compose.test_compose import DENSE, SHARED, finish
from tests.sharding.conftest import make_run


def snapshot(run, prefix: str) -> dict[str, bytes]:
    """Every object under a prefix, with its bytes."""
    return {o.key: run.store.read(o.key) for o in run.store.list(prefix)}


def truncate(run, key: str) -> None:
    data = run.store.read(key)
    run.store.write(key, data[: len(data) // 2])


def test_dry_run_prints_the_plan_and_writes_nothing(run2, tmp_path):
    finish(run2, "p01-02", tmp_path, {SHARED: 0.5})
    finish(run2, "p02-03", tmp_path)
    result = CliRunner().invoke(main, ["compose", run2.url, "--name", "planned", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "would write" in result.output and "p01-02, p02-03" in result.output and "model.safetensors" in result.output
    assert not run2.store.list("composed/planned")
    plan = plan_compose(run2, "planned")
    described = plan.describe(run2)
    assert described["paths"] == ["p01-02", "p02-03"] and described["tensors"]["merged"] > 0
    assert described["tensors"]["merged"] + described["tensors"]["unchanged"] == described["tensors"]["total"]


def test_a_failed_overwrite_leaves_the_old_model_byte_identical(run2, tmp_path):
    finish(run2, "p01-02", tmp_path, {SHARED: 0.5, DENSE.format(l=0): 0.25})
    finish(run2, "p02-03", tmp_path)
    compose_moe(run2, "m")
    before = snapshot(run2, "composed/m")
    assert "composed/m/model.safetensors" in before
    truncate(run2, "work/p02-03/final/model.safetensors")  # a path's final file truncated
    with pytest.raises(IntegrityError, match="p02-03"):
        compose_moe(run2, "m", overwrite=True)
    result = CliRunner().invoke(main, ["compose", run2.url, "--name", "m", "--overwrite"])
    assert result.exit_code == 1 and "p02-03" in result.output
    assert snapshot(run2, "composed/m") == before
    assert not [o for o in run2.store.fs.find(run2.store.root) if "/.paths-" in o]  # no staging left


def test_a_failure_while_writing_leaves_the_old_model_byte_identical(run2, tmp_path, monkeypatch):
    """A failure inside execute (after the plan passed) touches nothing of the old model."""
    import compose.merge as M

    finish(run2, "p01-02", tmp_path, {SHARED: 0.5})
    compose_moe(run2, "w")
    before = snapshot(run2, "composed/w")

    def broken(*args, **kwargs):
        raise OSError("disk full while writing")

    monkeypatch.setattr(M, "_record", broken)
    with pytest.raises(OSError, match="disk full"):
        compose_moe(run2, "w", overwrite=True, outer_lr=0.5)
    assert snapshot(run2, "composed/w") == before


def test_a_sharded_base_with_dtype_fails_before_touching_the_old_model(tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM

    from paths.base import build_model, load_spec, preset_path
    from paths.prepare.decompose import decompose
    from paths.prepare.init import init_run
    from storage.layout import open_run

    folder = str(tmp_path / "sharded-moe")
    build_model(load_spec(preset_path("tiny-mixtral"), "tiny-mixtral"), 0).save_pretrained(folder, max_shard_size="200KB")
    assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    url = str(tmp_path / "run")
    init_run(url, from_dir=folder, tokenizer_dir=tokenizer_dir)
    run = open_run(url)
    decompose(run, 1)
    finish(run, "p01", tmp_path, {SHARED: 0.5})
    compose_moe(run, "s")
    before = snapshot(run, "composed/s")
    assert sum(k.endswith(".safetensors") for k in before) > 1
    with pytest.raises(ConfigurationError, match="--dtype with a sharded base"):
        compose_moe(run, "s", overwrite=True, dtype="bfloat16")
    assert snapshot(run, "composed/s") == before
    AutoModelForCausalLM.from_pretrained(run.store.path("composed/s"))  # still whole


def test_a_successful_overwrite_replaces_the_model_whole(run2, tmp_path):
    finish(run2, "p01-02", tmp_path, {SHARED: 0.5})
    compose_moe(run2, "r", momentum=0.5)  # writes momentum.safetensors
    assert run2.store.exists("composed/r/momentum.safetensors")
    compose_moe(run2, "r", overwrite=True, outer_lr=0.5)  # no momentum: the old file must go
    assert not run2.store.exists("composed/r/momentum.safetensors")
    record = json.loads(run2.store.read("composed/r/compose.json"))
    assert record["options"]["outer_lr"] == 0.5
    base = load_file(run2.store.path("base/model.safetensors"))
    new = load_file(run2.store.path("composed/r/model.safetensors"))
    assert torch.allclose(new[SHARED], base[SHARED] + 0.25)


@pytest.mark.s3
def test_overwrite_on_seaweedfs_fails_safe_and_replaces_whole(seaweed, bucket, tokenizer_dir, tmp_path):
    from storage.admin import verify

    run = make_run(f"s3://{bucket}/overwrite-{tmp_path.name}", tokenizer_dir, 2, seaweed.storage_options)
    finish(run, "p01-02", tmp_path / "a", {SHARED: 0.5})
    compose_moe(run, "o", momentum=0.5)
    before = snapshot(run, "composed/o")
    finish(run, "p02-03", tmp_path / "b")
    truncate(run, "work/p02-03/final/model.safetensors")
    with pytest.raises(IntegrityError, match="p02-03"):
        compose_moe(run, "o", overwrite=True)
    assert snapshot(run, "composed/o") == before
    compose_moe(run, "o", paths=["p01-02"], overwrite=True, outer_lr=0.5)
    after = snapshot(run, "composed/o")
    assert "composed/o/momentum.safetensors" not in after and after != before
    assert not [p for p in run.store.fs.find(run.store.root) if "/.paths-" in p]  # the staging prefix is gone
    report = verify(run)
    assert not [p for p in report.problems if "composed/o" in str(p)], report.problems
