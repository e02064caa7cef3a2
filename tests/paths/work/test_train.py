"""`paths train`: exact resume after kill -9 (bitwise, as another worker), SIGTERM checkpoints
and hands the path back, fencing stops a worker that lost its lease, 4x1 accumulation equals 1x4,
sft masks the prompt, two gloo ranks split the data with only rank 0 writing, and bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from cli.main import main
from paths.work.claims import claim, read_claim, release, save_local
from paths.errors import LeaseLost
from paths.steps import targets_of
from paths.work.train import train
from paths.train_config import load_config
from sharding.shard import ShardOptions, shard
from tests.sharding.conftest import docs, make_run, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY = ["--set", "seq_len=32", "--set", "batch_size=4", "--set", "warmup_steps=2", "--no-progress"]


def lm_run(folder: str, tokenizer_dir: str):
    """A 16-path run with a hash-routed dataset `lm` (built the same way every time)."""
    run = make_run(folder, tokenizer_dir, 2)
    files = [write_jsonl(os.path.join(folder + "-in", "a.jsonl"), docs(480))]
    shard(run, ShardOptions(dataset="lm", inputs=files, id_field="id", holdout=0.0))
    return run


def cli(*args: str, home: str, wait: bool = True, env: dict | None = None):
    """`python -m cli.main ...` in its own process, as a worker runs it."""
    full_env = {**os.environ, "PATHS_HOME": home, **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        out, err = proc.communicate(timeout=300)
        return proc.returncode, out, err
    return proc


def final_weights(run, path: str) -> dict[str, torch.Tensor]:
    return load_file(run.store.path(f"{run.final(path)}/model.safetensors"))


def wait_for(predicate, timeout: float = 120, every: float = 0.02) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(every)


@pytest.mark.slow
def test_kill_9_then_another_worker_resumes_bitwise(tmp_path, tokenizer_dir):
    steps = ["--steps", "60", "--checkpoint-every", "10"]
    reference = lm_run(str(tmp_path / "ref"), tokenizer_dir)
    train(reference, "p01-02", "lm", "lm", load_config(None, [a for a in TINY[1::2] if "=" in a], steps=60, checkpoint_every=10), None, show_progress=False)

    run = lm_run(str(tmp_path / "run"), tokenizer_dir)
    a, b = str(tmp_path / "worker-a"), str(tmp_path / "worker-b")
    assert cli("claim", run.url, "--path", "p01-02", "--ttl", "5", home=a)[0] == 0
    proc = cli("train", run.url, "--dataset", "lm", *steps, *TINY, home=a, wait=False)
    wait_for(lambda: run.store.exists("work/p01-02/ckpt-20/COMMITTED"))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not run.store.exists("work/p01-02/final/manifest.json")
    wait_for(lambda: read_claim(run, "p01-02")[0]["expires_at"] < time.time(), timeout=10)
    claimed = []  # a takeover waits a jittered grace past expiry
    wait_for(lambda: claimed.append(cli("claim", run.url, "--path", "p01-02", "--ttl", "30", home=b)) or claimed[-1][0] == 0, timeout=15, every=0.3)
    code, out, err = claimed[-1]
    assert code == 0 and out.strip() == "p01-02", err
    code, out, err = cli("train", run.url, "--dataset", "lm", *steps, *TINY, home=b)
    assert code == 0, err
    record, _ = read_claim(run, "p01-02")
    assert record["state"] == "done" and record["generation"] == 2
    got, want = final_weights(run, "p01-02"), final_weights(reference, "p01-02")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    provenance = json.loads(run.store.read("work/p01-02/final/provenance.json"))
    assert provenance["steps"] == 60 and provenance["resumed_from"] >= 20
    metrics = [json.loads(x) for x in run.store.read("work/p01-02/metrics.jsonl").decode().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 61))


@pytest.mark.slow
def test_sigterm_commits_a_checkpoint_and_hands_the_path_back(tmp_path, tokenizer_dir):
    run = lm_run(str(tmp_path / "run"), tokenizer_dir)
    home = str(tmp_path / "w")
    assert cli("claim", run.url, "--path", "p00-03", "--ttl", "5", home=home)[0] == 0
    proc = cli("train", run.url, "--dataset", "lm", "--steps", "100000", "--checkpoint-every", "0", *TINY, home=home, wait=False)
    wait_for(lambda: (read_claim(run, "p00-03")[0] or {}).get("step", 0) >= 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "stopped by SIGTERM" in err, err
    committed = [s for s, c in run.checkpoints("p00-03") if c]
    assert len(committed) == 1 and committed[0] >= 3
    record, _ = read_claim(run, "p00-03")
    assert record["state"] == "open" and record["committed_step"] == committed[0]


def test_truncated_checkpoint_is_skipped_with_a_warning(run2, corpus):
    from paths import checkpoint

    shard(run2, ShardOptions(dataset="lm", inputs=corpus, holdout=0.0))
    cfg = load_config(sets=["seq_len=16", "batch_size=2", "keep_checkpoints=3"], steps=6, checkpoint_every=2)
    train(run2, "p00-00", "lm", "lm", cfg, None, show_progress=False)
    assert [s for s, c in run2.checkpoints("p00-00") if c] == [2, 4]
    key = "work/p00-00/ckpt-4/model.safetensors"
    data = run2.store.read(key)
    with open(run2.store.path(key), "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.warns(UserWarning, match="ckpt-4"):
        step, *_ = checkpoint.load_latest(run2, "p00-00")
    assert step == 2


def test_gradient_accumulation_4x1_equals_1x4(tmp_path, tokenizer_dir):
    runs = [lm_run(str(tmp_path / f"r{i}"), tokenizer_dir) for i in range(2)]
    train(runs[0], "p02-01", "lm", "lm", load_config(sets=["seq_len=16", "batch_size=4", "grad_accum=1", "checkpoint_every=0"], steps=3), None, show_progress=False)
    train(runs[1], "p02-01", "lm", "lm", load_config(sets=["seq_len=16", "batch_size=1", "grad_accum=4", "checkpoint_every=0"], steps=3), None, show_progress=False)
    a, b = final_weights(runs[0], "p02-01"), final_weights(runs[1], "p02-01")
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=1e-5) for k in a)


def test_a_worker_that_loses_its_lease_stops_and_writes_nothing(run2, corpus):
    shard(run2, ShardOptions(dataset="lm", inputs=corpus, holdout=0.0))
    lease = claim(run2, ["p03-00"], ttl=0.6, worker="me")
    threading.Timer(1.0, lambda: release(run2, "p03-00", "open", by="admin")).start()
    with pytest.raises(LeaseLost, match="p03-00"):
        train(run2, "p03-00", "lm", "lm", load_config(sets=["seq_len=16", "batch_size=2"], steps=100000, checkpoint_every=0), lease, show_progress=False)
    assert not run2.store.exists("work/p03-00/final/manifest.json")
    assert read_claim(run2, "p03-00")[0]["state"] == "open"


def test_sft_loss_covers_completion_tokens_only(run2, tmp_path):
    rows = [{"prompt": f"Q: {i} + {i} =", "completion": f" {2 * i}"} for i in range(40)]
    f = write_jsonl(str(tmp_path / "sft.jsonl"), rows)
    shard(run2, ShardOptions(dataset="sft", inputs=[f], kind="prompts", text_field="prompt", answer_field="completion", holdout=0.0, router="hash"))
    from paths.models import run_tokenizer
    from paths.work.sft_data import SFTDataset

    tok, _ = run_tokenizer(run2)
    manifest = json.loads(run2.store.read("data/sft/manifest.json"))
    path = max(manifest["paths"], key=lambda p: manifest["paths"][p]["train_docs"])
    ds = SFTDataset(run2, "sft", path, 32, tok, epochs=1)
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    record = ds.samples[int(batch["index"][0])]
    completion = len(record[0]) - record[1]  # completion tokens + EOS
    n = targets_of({k: v[:1] for k, v in batch.items()})
    assert n == completion
    summary = train(run2, path, "sft", "sft", load_config(sets=["seq_len=32", "batch_size=4"], steps=3, checkpoint_every=0), None, show_progress=False)
    assert summary["steps"] == 3 and summary["tokens"] > 0


@pytest.mark.slow
def test_two_gloo_ranks_split_the_data_and_only_rank_0_writes(tmp_path, tokenizer_dir):
    run = lm_run(str(tmp_path / "run"), tokenizer_dir)
    home = str(tmp_path / "w")
    assert cli("claim", run.url, "--path", "p01-01", home=home)[0] == 0
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    procs = [cli("train", run.url, "--dataset", "lm", "--steps", "4", "--checkpoint-every", "2", *TINY, home=home, wait=False, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    state = json.loads(run.store.read("work/p01-01/ckpt-2/state.json"))
    assert [d["rank"] for d in state["data"]] == [0, 1] and all(d["world_size"] == 2 for d in state["data"])
    provenance = json.loads(run.store.read("work/p01-01/final/provenance.json"))
    assert provenance["tokens"] == 4 * 2 * 4 * 32  # steps x ranks x batch x seq_len
    assert "trained p01-01" in results[0][0] and results[1][0] == ""  # rank 1 reports nothing


def test_bad_input_is_one_line_and_exit_1(run2, corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("PATHS_HOME", str(tmp_path / "home"))
    shard(run2, ShardOptions(dataset="lm", inputs=corpus, holdout=0.0))
    runner = CliRunner()

    def run_cli(*args):
        r = runner.invoke(main, list(args))
        assert r.exit_code == 1 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, (r.exit_code, r.stderr)
        return r.stderr

    assert "paths claim" in run_cli("train", run2.url, "--dataset", "lm", "--steps", "1")  # no claim
    lease = claim(run2, ["p00-00"], ttl=60, worker="someone-else")
    save_local(lease)
    release(run2, "p00-00", "open")
    claim(run2, ["p00-00"], ttl=60, worker="thief")
    assert "thief" in run_cli("train", run2.url, "--dataset", "lm", "--steps", "1")  # another worker's claim
    assert runner.invoke(main, ["claim", run2.url, "--path", "p00-01"]).exit_code == 0
    assert "unknown training setting 'lrr'" in run_cli("train", run2.url, "--dataset", "lm", "--set", "lrr=1")
    assert "steps must be > 0" in run_cli("train", run2.url, "--dataset", "lm", "--steps", "0")
    assert "not in" in run_cli("train", run2.url, "--dataset", "nope", "--steps", "1")
    mapping = tmp_path / "m.json"
    mapping.write_text(json.dumps({"code": "p03-03", "math": "p03-03", "prose": "p03-03"}))
    shard(run2, ShardOptions(dataset="one", inputs=corpus, router="domain", domain_field="domain", domain_map=str(mapping)))
    assert "no training tokens for path p00-01" in run_cli("train", run2.url, "--dataset", "one", "--steps", "1")


@pytest.mark.s3
def test_claim_train_resume_and_compose_on_seaweedfs(seaweed, bucket, tokenizer_dir, tmp_path, monkeypatch, killed_after_first_checkpoint):
    from compose.merge import compose_moe

    monkeypatch.setenv("PATHS_HOME", str(tmp_path / "home"))
    options = seaweed.storage_options
    run = make_run(f"s3://{bucket}/train-{tmp_path.name}", tokenizer_dir, 2, options)
    shard(run, ShardOptions(dataset="lm", inputs=[write_jsonl(str(tmp_path / "a.jsonl"), docs(200))], holdout=0.0), storage_options=options)
    cfg = load_config(sets=["seq_len=16", "batch_size=2", "keep_checkpoints=2"], steps=6, checkpoint_every=2)
    lease = claim(run, ["p02-02"], ttl=30, worker="w")
    with killed_after_first_checkpoint():
        train(run, "p02-02", "lm", "lm", cfg, lease, show_progress=False)
    assert [s for s, c in run.checkpoints("p02-02") if c] == [2]
    out = train(run, "p02-02", "lm", "lm", cfg, lease, show_progress=False)
    assert out["resumed_from"] == 2 and read_claim(run, "p02-02")[0]["state"] == "done"
    record = compose_moe(run, "s3")
    assert list(record["paths"]) == ["p02-02"]
    from storage.admin import verify

    assert verify(run).ok


def test_a_kill_between_commit_and_the_metrics_upload_loses_no_metrics(run2, corpus, monkeypatch):
    """Each checkpoint carries the metrics up to its step: dying right after COMMITTED, before
    work/<path>/metrics.jsonl is rewritten, leaves no gap in the resumed record."""
    from paths.trainer import Trainer

    shard(run2, ShardOptions(dataset="lm", inputs=corpus, holdout=0.0))
    cfg = load_config(sets=["seq_len=16", "batch_size=2"], steps=6, checkpoint_every=2)
    real, calls = Trainer.write_metrics, []

    def dies_at_the_second_checkpoint(self):
        calls.append(self.step)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed after ckpt-4 was committed")
        real(self)

    monkeypatch.setattr(Trainer, "write_metrics", dies_at_the_second_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        train(run2, "p01-01", "lm", "lm", cfg, None, show_progress=False)
    monkeypatch.setattr(Trainer, "write_metrics", real)
    assert [json.loads(x)["step"] for x in run2.store.read("work/p01-01/metrics.jsonl").decode().splitlines()] == [1, 2]
    assert train(run2, "p01-01", "lm", "lm", cfg, None, show_progress=False)["resumed_from"] == 4
    assert [json.loads(x)["step"] for x in run2.store.read("work/p01-01/metrics.jsonl").decode().splitlines()] == [1, 2, 3, 4, 5, 6]
