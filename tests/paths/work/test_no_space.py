"""A full disk (ENOSPC on a small tmpfs holding the run) while writing a checkpoint or a composed
model: a one-line error, the previous checkpoint or model intact, and after space is freed the same
command resumes and finishes, bitwise equal to a run that had room."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from paths.train_config import load_config
from paths.work.train import train
from sharding.shard import ShardOptions, shard
from storage.admin import verify
from tests.paths.work.test_train import TINY, final_weights
from tests.sharding.conftest import docs, make_run, write_jsonl


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs (64 MiB at first) and `resize(bytes)`; skipped where mounting is not allowed."""
    where = tmp_path / "disk"
    where.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True).returncode != 0:
        pytest.skip("needs to mount a tmpfs (root, or CAP_SYS_ADMIN)")

    def resize(size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True, capture_output=True)

    def used() -> int:
        st = os.statvfs(where)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    try:
        yield where, resize, used
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def built(url: str, tokenizer_dir: str, tmp_path) -> object:
    run = make_run(url, tokenizer_dir, 1)
    shard(run, ShardOptions(dataset="lm", inputs=[write_jsonl(str(tmp_path / "in" / "a.jsonl"), docs(240))], id_field="id", holdout=0.0))
    return run


def one_line(result, *parts: str) -> None:
    assert result.exit_code == 1 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, (result.exit_code, result.stderr)
    for part in parts:
        assert part in result.stderr, result.stderr


def test_a_full_disk_during_a_checkpoint_and_a_compose_loses_nothing(small_disk, tmp_path, tokenizer_dir):
    where, resize, used = small_disk
    cfg = load_config(sets=["seq_len=32", "batch_size=4", "warmup_steps=2"], steps=6, checkpoint_every=2)
    reference = built(str(tmp_path / "ref"), tokenizer_dir, tmp_path)
    train(reference, "p01", "lm", "lm", cfg, None, show_progress=False)
    checkpoint = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(reference.store.path("work/p01/ckpt-4")) for f in fs)

    run = built(str(where / "run"), tokenizer_dir, tmp_path)
    env = {"PATHS_HOME": str(tmp_path / "home")}
    assert CliRunner().invoke(main, ["claim", run.url, "--path", "p01"], env=env).exit_code == 0
    resize(used() + int(1.5 * checkpoint))  # room for one checkpoint, not for two
    args = ["train", run.url, "--dataset", "lm", "--steps", "6", "--checkpoint-every", "2", *TINY]
    one_line(CliRunner().invoke(main, args, env=env), "no space left on the device of", "run the same command again")
    assert [s for s, committed in run.checkpoints("p01") if committed] == [2]  # the previous checkpoint is intact
    assert not [o.key for o in run.store.list("work", hidden=True) if ".paths-tmp" in o.key]  # no half-written temp file holds the space

    resize(64 << 20)  # space freed: the same command resumes and finishes
    result = CliRunner().invoke(main, args, env=env)
    assert result.exit_code == 0, result.stderr
    provenance = json.loads(run.store.read("work/p01/final/provenance.json"))
    assert provenance["resumed_from"] == 2
    got, want = final_weights(run, "p01"), final_weights(reference, "p01")
    assert all(torch.equal(got[k], want[k]) for k in want)

    assert CliRunner().invoke(main, ["compose", run.url, "--into", "moe", "--name", "m"]).exit_code == 0
    before = run.store.read("composed/m/manifest.json")
    resize(used() + (200 << 10))  # far less than a model
    one_line(CliRunner().invoke(main, ["compose", run.url, "--into", "moe", "--name", "m", "--overwrite"]), "no space left", "is intact")
    assert run.store.read("composed/m/manifest.json") == before and verify(run).ok  # the previous model, whole
    resize(64 << 20)
    assert CliRunner().invoke(main, ["compose", run.url, "--into", "moe", "--name", "m", "--overwrite"]).exit_code == 0
    assert verify(run).ok and not [o.key for o in run.store.list("", hidden=True) if ".paths-" in o.key and "lock" not in o.key]
