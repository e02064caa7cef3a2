"""`paths finetune-moe`: router training lowers held-out loss on mixed data and leaves every other
weight bitwise alone; it runs through the one trainer, so resume after a crash is exact, metrics
are reloaded (tokens/s counts only the resumed process's tokens) and SIGTERM commits a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from cli.main import main
from compose.finetune import finetune_moe
from compose.merge import compose_moe
from paths.errors import ConfigurationError
from paths.work.train import train
from paths.train_config import load_config
from sharding.shard import ShardOptions, shard
from tests.sharding.conftest import docs, make_run, write_jsonl


@pytest.fixture(scope="module")
def composed(tmp_path_factory, tokenizer_dir):
    """A one-level tiny Mixtral whose 4 paths trained on moe-routed data, composed."""
    folder = tmp_path_factory.mktemp("btx")
    run = make_run(str(folder / "run"), tokenizer_dir, 1)
    files = [write_jsonl(str(folder / "in" / "a.jsonl"), docs(600))]
    shard(run, ShardOptions(dataset="mix", inputs=files, id_field="id", router="moe", holdout=0.1))
    for pid in ("p00", "p01", "p02", "p03"):
        train(run, pid, "lm", "mix", load_config(sets=["seq_len=32", "batch_size=4", "warmup_steps=1", "lr=3e-3"], steps=8, checkpoint_every=0), None, show_progress=False)
    compose_moe(run, "btx", router="centroid", router_data="mix")
    return run


def heldout_loss(run, name: str) -> float:
    from compose.evaluate import evaluate

    return evaluate(run, "mix", [f"composed:{name}"], split="heldout", seq_len=32)["table"][f"composed:{name}"]["overall"]


FT = ["seq_len=32", "batch_size=4", "warmup_steps=2", "lr=2e-2", "weight_decay=0"]


def test_router_training_lowers_heldout_loss_and_touches_only_routers(composed):
    cfg = load_config(sets=FT, steps=30, checkpoint_every=0)
    summary = finetune_moe(composed, "btx", "mix", "btx-ft", cfg, train="router", aux_loss=0.01, backend="reference", show_progress=False)
    assert summary["backend"] == "reference" and summary["shards"] == ["p00", "p01", "p02", "p03"]
    before, after = heldout_loss(composed, "btx"), heldout_loss(composed, "btx-ft")
    assert after < before, (before, after)
    old = load_file(composed.store.path("composed/btx/model.safetensors"))
    new = load_file(composed.store.path("composed/btx-ft/model.safetensors"))
    assert old.keys() == new.keys()  # the family's own layout, loadable by transformers
    changed = {k for k in old if not torch.equal(old[k], new[k])}
    assert changed and all(k.endswith("gate.weight") for k in changed), sorted(changed)[:4]


def test_finetune_resumes_exactly_after_a_crash(composed, monkeypatch):
    from paths import checkpoint

    cfg = load_config(sets=FT, steps=6, checkpoint_every=3)
    finetune_moe(composed, "btx", "mix", "straight", cfg, backend="reference", show_progress=False)
    real = checkpoint.prune

    def crash(*a, **k):
        real(*a, **k)
        raise KeyboardInterrupt("killed after a checkpoint")

    monkeypatch.setattr(checkpoint, "prune", crash)
    with pytest.raises(KeyboardInterrupt):
        finetune_moe(composed, "btx", "mix", "resumed", cfg, backend="reference", show_progress=False)
    monkeypatch.setattr(checkpoint, "prune", real)
    summary = finetune_moe(composed, "btx", "mix", "resumed", cfg, backend="reference", show_progress=False)
    assert summary["resumed_from"] == 3
    a = load_file(composed.store.path("composed/straight/model.safetensors"))
    b = load_file(composed.store.path("composed/resumed/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def _metrics(run, unit: str) -> list[dict]:
    return [json.loads(line) for line in run.store.read(f"work/{unit}/metrics.jsonl").decode().splitlines()]


def test_finetune_metrics_after_a_resume_equal_an_undisturbed_run(composed, monkeypatch):
    """The one trainer reloads metrics on resume: every step once, each the same as without a crash."""
    from paths import checkpoint

    cfg = load_config(sets=FT, steps=6, checkpoint_every=2)
    finetune_moe(composed, "btx", "mix", "m-straight", cfg, backend="reference", show_progress=False)
    real = checkpoint.prune
    calls = []

    def crash(*a, **k):
        real(*a, **k)
        calls.append(1)
        if len(calls) == 2:  # after the checkpoint at step 4
            raise KeyboardInterrupt("killed after a checkpoint")

    monkeypatch.setattr(checkpoint, "prune", crash)
    with pytest.raises(KeyboardInterrupt):
        finetune_moe(composed, "btx", "mix", "m-resumed", cfg, backend="reference", show_progress=False)
    monkeypatch.setattr(checkpoint, "prune", real)
    assert finetune_moe(composed, "btx", "mix", "m-resumed", cfg, backend="reference", show_progress=False)["resumed_from"] == 4
    straight, resumed = _metrics(composed, "moe-m-straight"), _metrics(composed, "moe-m-resumed")
    assert [m["step"] for m in resumed] == list(range(1, 7))
    for a, b in zip(straight, resumed):
        assert {k: a[k] for k in ("step", "loss", "aux_loss", "lr", "tokens")} == {k: b[k] for k in ("step", "loss", "aux_loss", "lr", "tokens")}
    # tokens/s counts only what this process trained, since its loop started at t0: steps 5 and 6
    # must agree on one t0 when tokens are counted from the resume (they would not counting all)
    t4, m5, m6 = resumed[3], resumed[4], resumed[5]
    t0_5 = m5["time"] - (m5["tokens"] - t4["tokens"]) / m5["tokens_per_s"]
    t0_6 = m6["time"] - (m6["tokens"] - t4["tokens"]) / m6["tokens_per_s"]
    assert abs(t0_5 - t0_6) < 0.005, (t0_5, t0_6)


@pytest.mark.slow
def test_finetune_sigterm_commits_a_checkpoint_and_a_rerun_resumes(composed, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from paths.trainer import read_metrics

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sets = [a for s in FT for a in ("--set", s)]
    args = [sys.executable, "-m", "cli.main", "finetune-moe", composed.url, "--model", "composed:btx", "--dataset", "mix", "--out", "sig",
            "--moe-backend", "reference", "--checkpoint-every", "2", "--no-progress", *sets]
    env = {**os.environ, "PATHS_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([*args, "--steps", "100000"], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not composed.store.exists("work/moe-sig/ckpt-2/COMMITTED"):
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else "timed out"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "stopped by SIGTERM" in err, err
    committed = max(s for s, c in composed.checkpoints("moe-sig") if c)
    assert committed >= 2 and not composed.store.exists("composed/sig/manifest.json")
    assert [m["step"] for m in read_metrics(composed, "moe-sig")] == list(range(1, committed + 1))
    done = subprocess.run([*args, "--steps", str(committed + 2)], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    record = json.loads(composed.store.read("composed/sig/compose.json"))
    assert record["resumed_from"] == committed and record["steps"] == committed + 2
    assert [m["step"] for m in read_metrics(composed, "moe-sig")] == list(range(1, committed + 3))


def test_finetune_bad_input(composed):
    cfg = load_config(sets=FT, steps=1)
    with pytest.raises(ConfigurationError, match="--train must be router or all"):
        finetune_moe(composed, "btx", "mix", "x", cfg, train="experts")
    with pytest.raises(ConfigurationError, match="already exists"):
        finetune_moe(composed, "btx", "mix", "btx", cfg)
    result = CliRunner().invoke(main, ["finetune-moe", composed.url, "--model", "composed:nope", "--dataset", "mix"])
    assert result.exit_code == 1 and "no composed model 'nope'" in result.output
    if not torch.cuda.is_available():
        result = CliRunner().invoke(main, ["finetune-moe", composed.url, "--model", "composed:btx", "--dataset", "mix", "--out", "y", "--moe-backend", "megablocks"])
        assert result.exit_code == 1 and "needs CUDA and the megablocks package" in result.output


def test_lora_finetune_trains_attention_adapters_and_routers_resumes_exactly_and_merges(composed, monkeypatch):
    from paths import checkpoint

    cfg = load_config(sets=[*FT, "lora_rank=4", "lr=5e-3"], steps=6, checkpoint_every=3)
    summary = finetune_moe(composed, "btx", "mix", "lora-straight", cfg, backend="reference", show_progress=False)
    assert summary["lora"]["targets"] == ["attention"]
    real = checkpoint.prune

    def crash(*a, **k):
        real(*a, **k)
        raise KeyboardInterrupt("killed after a checkpoint")

    monkeypatch.setattr(checkpoint, "prune", crash)
    with pytest.raises(KeyboardInterrupt):
        finetune_moe(composed, "btx", "mix", "lora-resumed", cfg, backend="reference", show_progress=False)
    monkeypatch.setattr(checkpoint, "prune", real)
    assert finetune_moe(composed, "btx", "mix", "lora-resumed", cfg, backend="reference", show_progress=False)["resumed_from"] == 3
    old = load_file(composed.store.path("composed/btx/model.safetensors"))
    a = load_file(composed.store.path("composed/lora-straight/model.safetensors"))
    b = load_file(composed.store.path("composed/lora-resumed/model.safetensors"))
    assert a.keys() == old.keys() and all(torch.equal(a[k], b[k]) for k in a)
    changed = {k for k in old if not torch.equal(old[k], a[k])}
    assert any("self_attn" in k for k in changed) and any(k.endswith("gate.weight") for k in changed)
    assert all("self_attn" in k or k.endswith("gate.weight") for k in changed), sorted(changed)[:4]
    with pytest.raises(ConfigurationError, match="finetune-moe --lora trains an adapter"):
        finetune_moe(composed, "btx", "mix", "lora-all", cfg, train="all", backend="reference", show_progress=False)
