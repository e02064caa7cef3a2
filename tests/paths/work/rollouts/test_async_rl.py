"""Asynchronous GRPO through the bucket: a rollout worker and a trainer in separate processes (local
folder and SeaweedFS), exact resume over a fixed set of rollout batches, lying workers rejected with
nothing taken from them while training goes on, and bad input."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from paths.train_config import load_config
from paths.work.rewards import load_reward
from paths.work.rollouts import batch_key, decode, encode, publish, rollout_worker, set_open
from paths.work.rollouts.worker import holds_back
from paths.work.train import train
from tests.paths.work.conftest import FAST, loaded, metrics, prompt_run
from tests.paths.work.rollouts.conftest import REWARD, SALT, STORE, final, keyed, settings, start, worker
from tests.paths.work.test_train import cli


@pytest.mark.parametrize("backend, lora", [("local", []), ("s3", []), ("local", ["--lora", "4"]), ("s3", ["--lora", "4"])], ids=["local-delta", "s3-delta", "local-adapter", "s3-adapter"])
def test_a_rollout_worker_feeds_a_trainer_in_another_process(backend, lora, tmp_path, tokenizer_dir, request):
    env = {}
    if backend == "s3":
        from tests.sharding.conftest import make_run

        server, bucket = request.getfixturevalue("s3_env"), request.getfixturevalue("bucket")  # this process reads the run too
        env = server.env()
        url = f"s3://{bucket}/async-{tmp_path.name}"
        run = make_run(url, tokenizer_dir, 1, server.storage_options)
        from paths.work.tasks import arithmetic, write_jsonl
        from sharding.shard import ShardOptions, shard

        f = str(tmp_path / "tasks.jsonl")
        write_jsonl(arithmetic(200, [1, 2]), f)
        shard(run, ShardOptions(dataset="rl", inputs=[f], kind="prompts", text_field="prompt", holdout=0.0), storage_options=server.storage_options)
    else:
        run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
        url = run.url
    sets = [a for s in [*FAST, "lr=1e-2"] for a in ("--set", s)]
    key_file = str(tmp_path / "w1.key")
    code, out, _ = cli("keys", "new", "--out", key_file, home=str(tmp_path / "w"), env=env)
    public = out.strip().rsplit(" ", 1)[1]
    assert code == 0 and cli("keys", "admit", url, "--name", "w1", "--key", public, home=str(tmp_path / "w"), env=env)[0] == 0
    home = str(tmp_path / "trainer")
    assert cli("claim", url, "--path", "p00", "--ttl", "60", home=home, env=env)[0] == 0
    trainer = cli("train", url, "--mode", "grpo", "--dataset", "rl", "--rollouts", "store", "--max-async", "2", "--steps", "4", *sets, *lora, "--set", "rollout_wait=120",
                  "--no-progress", home=home, wait=False, env=env)
    code, out, err = cli("rollout", url, "--path", "p00", "--dataset", "rl", "--key", key_file, "--batches", "100", *sets, "--no-progress", home=str(tmp_path / "w"), env=env)
    assert code == 0, err
    written = re.search(r"wrote (\d+) rollout batches of p00 as w1 \(signed by [0-9a-f]{16}\.\.\., fp32", out)
    # held back while max_async + 1 batches wait: at most 3 per latest.json the trainer writes (version 0, then per step at most one
    # "starving" notice and one new version), far from the 100 asked for; stopped once the path is done
    assert written and 4 <= int(written.group(1)) <= 3 * (1 + 2 * 4), out
    stdout, stderr = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, stderr
    assert re.search(r"rollouts: seed-checking 13 of 32 rows per batch, picked in secret: a batch with 25% forged rows is rejected with probability 0\.99", stdout), stdout
    from storage.layout import open_run

    run = open_run(url, None)
    steps = metrics(run, "p00")
    assert [m["store_batches"] for m in steps] == [1, 1, 1, 1] and all(m["own_batches"] == 0 for m in steps)  # every step from the worker
    assert all(0 <= m["policy_lag"] <= 2 for m in steps) and all("mismatch_masked" in m for m in steps)
    assert not run.store.list("rollouts/p00/rejected")
    head = json.loads(run.store.read("policy/p00/latest.json"))
    assert head["version"] == 4  # published after each step
    assert head["kind"] == ("adapter" if lora else "delta") and head["snapshot"] == (4 if lora else 0)  # what changed, workers rebuilding the rest


def test_exact_resume_over_a_fixed_set_of_batches(tmp_path, tokenizer_dir, killed_after_first_checkpoint):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    worker(run, 6, keyed(run, tmp_path, "w1"))
    worker(run, 2, keyed(run, tmp_path, "w2"))
    copy = str(tmp_path / "copy")
    shutil.copytree(run.url, copy)
    from storage.layout import open_run

    other = open_run(copy)
    cfg = load_config(sets=[*FAST, *STORE, "checkpoint_every=2"], steps=5)
    train(run, "p00", "grpo", "rl", cfg, None, show_progress=False, rewards=[REWARD])
    with killed_after_first_checkpoint():
        train(other, "p00", "grpo", "rl", cfg, None, show_progress=False, rewards=[REWARD])
    assert train(other, "p00", "grpo", "rl", cfg, None, show_progress=False, rewards=[REWARD])["resumed_from"] == 2
    a, b = final(run), final(other)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise
    assert [m["reward_mean"] for m in metrics(run, "p00")] == [m["reward_mean"] for m in metrics(other, "p00")]
    assert all(m["store_batches"] == 1 for m in metrics(other, "p00"))  # 5 of the 8 batches, each once: none twice, none lost


def test_workers_are_told_every_batch_waiting_in_order(tmp_path, tokenizer_dir):
    """latest.json's `pending` counts every batch the coming steps can take, not only each chain's
    next one (a worker faster than its trainer then queued batches until they went stale), and
    not a batch behind a gap in its chain (it cannot be taken)."""
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    worker(run, 6, keyed(run, tmp_path, "w1"))
    worker(run, 3, keyed(run, tmp_path, "w2"))
    run.store.delete(batch_key(run, "p00", "w2", 0))  # w2's chain waits for a position that never comes
    train(run, "p00", "grpo", "rl", load_config(sets=[*FAST, *STORE], steps=1), None, show_progress=False, rewards=[REWARD])
    assert metrics(run, "p00")[0]["store_batches"] == 1
    head = json.loads(run.store.read("policy/p00/latest.json"))
    assert head["pending"] == 5  # w1's other five
    assert head["heard"] == {"w1": 5, "w2": 2}  # the highest object listed in each folder: a worker's newer ones are not in `pending`


def test_a_worker_samples_while_its_batch_would_be_taken_within_max_async():
    """A batch sampled now queues behind the `pending` batches the trainer counted and the worker's
    own it did not count (numbered above `heard`), and is taken that many steps (of `needs`
    batches) on: the worker samples while that is at most max_async, leaving one place to other
    workers where there are any."""
    head = {"version": 7, "max_async": 2, "needs": 1, "pending": 2, "heard": {"w": 11}}
    assert not holds_back(head, "w", [10, 11], 0, 2)  # taken at step 7 + 2: max_async behind
    assert holds_back(head, "w", [11, 12], 0, 2)  # number 12 was not counted: step 7 + 3, stale
    assert holds_back({**head, "pending": 3}, "w", [], 0, 2)
    assert not holds_back({**head, "pending": 5, "needs": 2}, "w", [], 0, 2)  # the sixth batch of steps taking two each: step 7 + 2
    assert holds_back({**head, "pending": 0, "max_async": 0}, "w", [12], 0, 2)  # on-policy: one batch, for the coming step
    assert not holds_back({**head, "pending": 0, "heard": {}}, "other", [0], 0, 2)  # nothing of its folder listed yet: its one batch is not counted
    shared = {**head, "heard": {"w": 11, "v": 3}}  # another worker writes too: a batch it samples now is in no count
    assert holds_back(shared, "w", [11], 0, 2) and not holds_back({**shared, "pending": 1}, "w", [11], 0, 2)
    assert not holds_back({**shared, "pending": 0, "max_async": 0}, "w", [11], 0, 2)  # nothing waits: always a batch for the coming step
    old = {k: v for k, v in head.items() if k != "heard"}  # a trainer that does not say what it listed: batches written since it was seen, one place spare
    assert holds_back(old, "w", [], 0, 2) and not holds_back({**old, "pending": 1}, "w", [], 0, 2) and holds_back({**old, "pending": 1}, "w", [], 1, 2)


def test_async_bad_input(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    set_open(run, True)
    runner = CliRunner()
    r = runner.invoke(main, ["train", run.url, "--path", "p00", "--mode", "grpo", "--dataset", "rl", "--rollouts", "store", "--max-async", "-1"])
    assert r.exit_code == 1 and "--max-async must be >= 0" in r.output
    r = runner.invoke(main, ["train", run.url, "--path", "p00", "--mode", "lm", "--dataset", "rl", "--rollouts", "store"])
    assert r.exit_code == 1 and "--rollouts store feeds --mode grpo" in r.output
    r = runner.invoke(main, ["rollout", run.url, "--path", "p09", "--dataset", "rl", "--no-progress"])
    assert r.exit_code == 1 and "p09 has no prompt shard in dataset 'rl'" in r.output
    r = runner.invoke(main, ["rollout", run.url, "--path", "p00", "--dataset", "rl", "--wait", "0.5", "--no-progress"])
    assert r.exit_code == 1 and "no policy of p00 was published" in r.output
    assert not run.store.list("rollouts")


def test_sapo_mixes_other_paths_experience_rescored(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    model, _ = loaded(run, tmp_path, "p01")
    publish(run, "p01", 0, model, SALT, max_async=10, step=0)
    other = keyed(run, tmp_path, "other")
    rollout_worker(run, "p01", "rl", settings(), [load_reward(REWARD)], key=other, batches=1, wait=5)
    key = run.store.list("rollouts/p01/batches")[0].key
    lie = decode(run.store.read(key), key, 1 << 30)
    run.store.write(key, encode(lie.completion_ids, lie.behaviour_logp_NC, {**lie.meta, "rewards": [5.0] * len(lie.completion_ids)}, other))  # what they state is never used
    worker(run, 3, keyed(run, tmp_path, "own"))
    cfg = load_config(sets=[*FAST, *STORE, "external=2", "policy_snapshot_every=0"], steps=3)  # every version full: gc keeps the latest alone
    train(run, "p00", "grpo", "rl", cfg, None, show_progress=False, rewards=[REWARD])
    steps = metrics(run, "p00")
    assert [m["external_groups"] for m in steps] == [2, 2, 0]  # p01's batch holds 4 prompt groups, each taken once
    assert all(m["store_batches"] == 1 for m in steps)
    assert all(0 <= m["external_reward"] <= 1 for m in steps[:2])  # re-scored by p00's verifier (stated: 5.0)
    from storage.admin import gc_apply, gc_plan

    plan = {item.key: item.reason for item in gc_plan(run, 0, 2)}  # p00 is finished, p01 is not
    assert {k for k in plan if k.startswith("policy/")} == {"policy/p00/v00000000", "policy/p00/v00000001", "policy/p00/v00000002"}
    assert "rollouts/p00/batches" in plan and not any(k.startswith(("policy/p01", "rollouts/p01")) for k in plan)
    gc_apply(run, [i for i in gc_plan(run, 0, 2) if i.key.startswith(("policy/", "rollouts/"))])
    assert json.loads(run.store.read("policy/p00/latest.json"))["version"] == 3 and run.store.exists("policy/p00/v00000003/model.safetensors")


def test_no_litter_after_a_kill_a_resume_and_gc(tmp_path, tokenizer_dir, killed_after_first_checkpoint):
    """Conditional writes on a local folder (lease renewals, pruned policy versions, checkpoints)
    leave no lock files; what a killed trainer left, `storage gc` takes away."""
    import os

    from paths.work.claims import claim
    from storage.admin import gc_apply, gc_plan

    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    worker(run, 6, keyed(run, tmp_path, "w1"))
    lease = claim(run, ["p00"], ttl=30, worker="t")
    cfg = load_config(sets=[*FAST, *STORE, "checkpoint_every=2", "max_async=1", "keep_checkpoints=1", "policy_snapshot_every=0"], steps=6)  # full versions: gc keeps the last alone
    with killed_after_first_checkpoint():
        train(run, "p00", "grpo", "rl", cfg, lease, show_progress=False, rewards=[REWARD])
    os.makedirs(run.store.path("work/p00/ckpt-9"))  # a folder a crash emptied
    with open(run.store.path("claims/.paths-lock-p00.json"), "w"):  # the lock of a holder killed while holding it
        pass
    assert train(run, "p00", "grpo", "rl", cfg, lease, show_progress=False, rewards=[REWARD])["resumed_from"] == 2

    def litter() -> list[str]:
        out = []
        for folder, subs, files in os.walk(run.url):
            out += [os.path.join(folder, f) for f in files if f.startswith(".paths-")]
            out += [folder] if not subs and not files else []
        return out

    assert litter() and not any("lock-" in p for p in litter() if "claims/.paths-lock-p00.json" not in p)  # writes leave no lock files
    gc_apply(run, gc_plan(run, 0, 1))
    assert litter() == []
    assert run.store.exists("work/p00/final/model.safetensors") and len(run.store.list("policy/p00")) == 3  # latest.json and the last version
