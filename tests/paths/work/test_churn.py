"""Workers that survive churn: a lease is renewed from the first second of `paths train`, a
worker renewing on time is never taken from, TTLs too short to keep are refused, bad homes and
hand-edited claim records fail in one line, and a soak test: worker loops on SeaweedFS whose
training processes are SIGKILLed at random finish every path exactly once, bitwise equal to an
undisturbed run, with nothing orphaned after gc."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from paths.train_config import load_config
from paths.work.claims import read_claim
from paths.work.train import train
from tests.paths.work.test_train import ROOT, TINY, cli, final_weights, lm_run


def one_line_error(result, *parts: str) -> None:
    assert result.exit_code == 1 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, (result.exit_code, result.stderr)
    for part in parts:
        assert part in result.stderr, result.stderr


# -- a lease covered from the first second ------------------------------------------------------------
SLOW_TORCH = """import os, sys, time

class SlowTorch:  # the first `import torch` of the process waits SLOW_IMPORT_S seconds
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            time.sleep(float(os.environ.get("SLOW_IMPORT_S", "0")))
        return None

sys.meta_path.insert(0, SlowTorch())
"""


@pytest.mark.slow
def test_train_renews_before_its_heavy_work_and_is_never_taken_from(tmp_path, tokenizer_dir):
    """A busy machine: importing torch takes 7 s (a cold disk, a loaded node), longer than the
    --ttl 5 lease. `paths train` renews within a second or so of starting, before that import, and
    keeps renewing through it: a second worker trying to claim the path the whole time never gets
    it, and the path ends done in generation 1."""
    run = lm_run(str(tmp_path / "run"), tokenizer_dir)
    home = str(tmp_path / "a")
    slow = tmp_path / "slow-start"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_TORCH)
    assert cli("claim", run.url, "--path", "p01-01", "--ttl", "5", home=home)[0] == 0
    claimed_at = read_claim(run, "p01-01")[0]["renewed_at"]
    started = time.time()
    env = {"PYTHONPATH": f"{slow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "SLOW_IMPORT_S": "7"}
    proc = cli("train", run.url, "--dataset", "lm", "--steps", "40", "--checkpoint-every", "10", *TINY, home=home, wait=False, env=env)
    renewals, thief = [], []
    while proc.poll() is None:
        record = read_claim(run, "p01-01")[0]
        if record["state"] == "claimed" and record["renewed_at"] > claimed_at and not renewals:
            renewals.append((record["renewed_at"] - started, "step" in record))
        thief.append(CliRunner().invoke(main, ["claim", run.url, "--path", "p01-01", "--ttl", "60"], env={"PATHS_HOME": str(tmp_path / "thief")}).exit_code)
        time.sleep(0.05)
    assert proc.returncode == 0, proc.communicate()
    first, stepping = renewals[0]
    assert first < 3.0 and not stepping, renewals  # renewed long before torch was in, let alone a step
    assert time.time() - started > 7
    assert set(thief) == {3}  # nothing to claim, every time
    record = read_claim(run, "p01-01")[0]
    assert record["state"] == "done" and record["generation"] == 1


def test_a_ttl_too_short_is_refused_naming_a_workable_one(run2, tmp_path):
    result = CliRunner().invoke(main, ["claim", run2.url, "--ttl", "2"], env={"PATHS_HOME": str(tmp_path / "h")})
    one_line_error(result, "--ttl 2 is too short", "use --ttl 10 or more")
    assert all(read_claim(run2, p)[0] is None for p in ("p00-00", "p03-03"))


def test_an_unwritable_home_fails_before_anything_is_claimed(run2, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = CliRunner().invoke(main, ["claim", run2.url, "--path", "p00-00"], env={"PATHS_HOME": str(blocker / "home")})
    one_line_error(result, str(blocker / "home"), "set PATHS_HOME to a writable folder")
    assert read_claim(run2, "p00-00")[0] is None


def test_a_claim_record_edited_into_nonsense_names_the_file_and_the_fix(run2, tmp_path):
    env = {"PATHS_HOME": str(tmp_path / "h")}
    run2.store.write(run2.claim("p01-01"), b'{"state": "claimed", "generation": "many"')
    result = CliRunner().invoke(main, ["claim", run2.url, "--path", "p01-01"], env=env)
    one_line_error(result, "claims/p01-01.json is not a claim record", f"paths storage release {run2.url} --path p01-01")
    assert CliRunner().invoke(main, ["storage", "release", run2.url, "--path", "p01-01"], env=env).exit_code == 0
    result = CliRunner().invoke(main, ["claim", run2.url, "--path", "p01-01"], env=env)
    assert result.exit_code == 0 and read_claim(run2, "p01-01")[0]["state"] == "claimed"


# -- the soak test ----------------------------------------------------------------------------------------
STEPS = ["--steps", "12", "--checkpoint-every", "3"]


class WorkerLoop(threading.Thread):
    """`while paths claim; do paths train; done` as a user runs it, one process per command."""

    def __init__(self, url: str, home: str, env: dict[str, str], live: dict, lock: threading.Lock, all_done):
        super().__init__(daemon=True)
        self.url, self.home, self.env, self.live, self.lock, self.all_done = url, home, env, live, lock, all_done
        self.trained, self.killed, self.fenced, self.errors = 0, 0, 0, []

    def run(self) -> None:
        full = {**os.environ, **self.env, "PATHS_HOME": self.home, "OMP_NUM_THREADS": "1"}
        deadline = time.time() + 600
        while time.time() < deadline:
            code = subprocess.run([sys.executable, "-m", "cli.main", "claim", self.url, "--ttl", "5"], cwd=ROOT, env=full, capture_output=True, text=True)
            if code.returncode == 3:  # nothing claimable now: done, or a killed worker's lease still runs
                if self.all_done():
                    return
                time.sleep(1.0)
                continue
            if code.returncode != 0:
                self.errors.append(code.stderr)
                return
            proc = subprocess.Popen([sys.executable, "-m", "cli.main", "train", self.url, "--dataset", "lm", *STEPS, *TINY], cwd=ROOT, env=full,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            with self.lock:
                self.live[proc.pid] = proc
            _, err = proc.communicate()
            with self.lock:
                self.live.pop(proc.pid, None)
            if proc.returncode == -signal.SIGKILL:
                self.killed += 1
            elif proc.returncode == 0:
                self.trained += 1
            elif "lost the lease" in err:  # fenced: a takeover from a worker that was renewing (a storm)
                self.fenced += 1
            else:
                self.errors.append(err[-2000:])


@pytest.mark.slow
@pytest.mark.s3
def test_soak_worker_loops_survive_random_kills_on_seaweedfs(seaweed, bucket, tokenizer_dir, tmp_path):
    from paths.units import decomposed_paths
    from storage.admin import gc_apply, gc_plan, verify
    from storage.layout import open_run

    cfg = load_config(sets=["seq_len=32", "batch_size=4", "warmup_steps=2"], steps=12, checkpoint_every=3)
    url = f"s3://{bucket}/soak-{tmp_path.name}"
    from tests.sharding.conftest import docs, make_run, write_jsonl
    from sharding.shard import ShardOptions, shard

    run = make_run(url, tokenizer_dir, 1, seaweed.storage_options)
    files = [write_jsonl(str(tmp_path / "in" / "a.jsonl"), docs(480))]
    shard(run, ShardOptions(dataset="lm", inputs=files, id_field="id", holdout=0.0), storage_options=seaweed.storage_options)
    ref = make_run(str(tmp_path / "ref1"), tokenizer_dir, 1)
    shard(ref, ShardOptions(dataset="lm", inputs=files, id_field="id", holdout=0.0))
    paths = decomposed_paths(ref)[1]
    for pid in paths:
        train(ref, pid, "lm", "lm", cfg, None, show_progress=False)

    live: dict[int, subprocess.Popen] = {}
    lock = threading.Lock()
    watcher = open_run(url, seaweed.storage_options)
    all_done = lambda: all((read_claim(watcher, p)[0] or {}).get("state") == "done" for p in paths)  # noqa: E731
    loops = [WorkerLoop(url, str(tmp_path / f"w{i}"), seaweed.env(), live, lock, all_done) for i in range(3)]
    started = time.time()
    for loop in loops:
        loop.start()
    rng, kills = random.Random(0), 0
    while any(loop.is_alive() for loop in loops) and time.time() - started < 45:
        time.sleep(rng.uniform(1.5, 3.5))
        with lock:
            victims = [p for p in live.values() if p.poll() is None]
        if victims:
            rng.choice(victims).send_signal(signal.SIGKILL)
            kills += 1
    for loop in loops:
        loop.join(timeout=600)
    elapsed = time.time() - started
    assert not any(loop.errors for loop in loops), [e for loop in loops for e in loop.errors]
    assert sum(loop.fenced for loop in loops) == 0  # no worker was taken from while it renewed
    assert kills >= 5 and sum(loop.killed for loop in loops) >= 3, (kills, [loop.killed for loop in loops])

    run = open_run(url, seaweed.storage_options)
    generations = {}
    for pid in paths:
        record, _ = read_claim(run, pid)
        assert record["state"] == "done", (pid, record)
        generations[pid] = record["generation"]
        got, want = final_weights_s3(run, pid), final_weights(ref, pid)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), pid
        steps = [json.loads(x)["step"] for x in run.store.read(f"work/{pid}/metrics.jsonl").decode().splitlines()]
        assert steps == list(range(1, 13)), (pid, steps)
    assert sum(g - 1 for g in generations.values()) <= kills  # a takeover only follows a kill
    assert verify(run).ok
    removed = gc_apply(run, gc_plan(run, older_than_s=0, keep=1))
    keys = [o.key for o in run.store.list("work", hidden=True)]
    checkpoints = {k.rsplit("/", 1)[0] for k in keys if "/ckpt-" in k}
    assert all(f"{c}/COMMITTED" in keys for c in checkpoints), sorted(checkpoints)  # no orphaned checkpoint
    assert not [k for k in keys if ".paths-" in k or ".tmp" in k]  # no temp or staged object
    assert verify(run).ok
    print(f"soak: {kills} kills, generations {generations}, {elapsed:.0f}s, gc removed {removed} objects")


def final_weights_s3(run, pid: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(run.store.read(f"{run.final(pid)}/model.safetensors"))
