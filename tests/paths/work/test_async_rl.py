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
from safetensors.torch import load_file

from cli.main import main
from paths.train_config import load_config
from paths.work.grpo import score_samples
from paths.work.rewards import load_reward
from paths.work.rollouts import batch_key, decode, encode, publish, rollout_worker
from paths.work.train import train
from tests.paths.work.conftest import FAST, loaded, metrics, prompt_run
from tests.paths.work.test_train import cli

STORE = ["rollouts=store", "max_async=10", "rollout_wait=0", "lr=1e-2"]
REWARD = "math_answer"


def settings(*extra: str):
    return load_config(sets=[*FAST, *STORE, *extra], mode=None)


def worker(run, n: int, name: str = "honest", cfg=None):
    return rollout_worker(run, "p00", "rl", cfg or settings(), [load_reward(REWARD)], worker=name, batches=n, wait=5)


def start(run, tmp_path):
    """Policy version 0 of p00 (its starting weights), as the trainer publishes it."""
    model, _ = loaded(run, tmp_path)
    publish(run, "p00", 0, model, max_async=10, step=0)


def final(run, path: str = "p00") -> dict[str, torch.Tensor]:
    return load_file(run.store.path(f"work/{path}/final/model.safetensors"))


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_rollout_worker_feeds_a_trainer_in_another_process(backend, tmp_path, tokenizer_dir, request):
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
    home = str(tmp_path / "trainer")
    assert cli("claim", url, "--path", "p00", "--ttl", "60", home=home, env=env)[0] == 0
    trainer = cli("train", url, "--mode", "grpo", "--dataset", "rl", "--rollouts", "store", "--max-async", "2", "--steps", "4", *sets, "--set", "rollout_wait=120",
                  "--no-progress", home=home, wait=False, env=env)
    code, out, err = cli("rollout", url, "--path", "p00", "--dataset", "rl", "--worker", "w1", "--batches", "100", *sets, "--no-progress", home=str(tmp_path / "w"), env=env)
    assert code == 0, err
    written = re.search(r"wrote (\d+) rollout batches of p00 as w1 \(fp32", out)
    assert written and 4 <= int(written.group(1)) <= 4 + 2 * 3, out  # held back while max_async + 1 batches wait; stopped once the path is done
    stdout, stderr = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, stderr
    from storage.layout import open_run

    run = open_run(url, None)
    steps = metrics(run, "p00")
    assert [m["store_batches"] for m in steps] == [1, 1, 1, 1] and all(m["own_batches"] == 0 for m in steps)  # every step from the worker
    assert all(0 <= m["policy_lag"] <= 2 for m in steps) and all("mismatch_masked" in m for m in steps)
    assert not run.store.list("rollouts/p00/rejected")
    assert json.loads(run.store.read("policy/p00/latest.json"))["version"] == 4  # published after each step


def test_exact_resume_over_a_fixed_set_of_batches(tmp_path, tokenizer_dir, killed_after_first_checkpoint):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    worker(run, 6, "w1")
    worker(run, 2, "w2")
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


def forged(run, key: str, name: str, index: int, change) -> str:
    """A copy of an honest batch under another worker's name, changed by `change(meta, ids, logp)`."""
    batch = decode(run.store.read(key), key, 1 << 30)
    meta = {**batch.meta, "worker": name, "batch": index}
    ids, logp = [list(c) for c in batch.completion_ids], batch.behaviour_logp_NC.clone()
    out = change(meta, ids, logp)
    data = out if isinstance(out, bytes) else encode(ids, logp, meta)
    target = batch_key(run, "p00", name, index)
    run.store.write(target, data)
    return target


def test_lying_workers_are_rejected_and_nothing_of_theirs_is_learned(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    worker(run, 3, "honest")
    honest = sorted(o.key for o in run.store.list("rollouts/p00/batches/honest"))
    _, tokenizer = loaded(run, tmp_path)
    cfg = settings()
    reward = [load_reward(REWARD)]

    def rewards_flipped(meta, ids, logp):
        meta["rewards"] = [1.0 - r for r in meta["rewards"]]

    def other_model(meta, ids, logp):  # made-up completions, honestly scored, with the log-probs copied
        from sharding.dataset import read_prompts

        g = torch.Generator().manual_seed(1)
        for c in ids:
            c[:] = torch.randint(4, len(tokenizer), (len(c),), generator=g).tolist()
        recs = read_prompts(run, "rl", "p00")
        records = [recs[i] for i in meta["prompt_index"]]
        meta["rewards"] = score_samples(records, ids, [True] * len(ids), reward, cfg, tokenizer).rewards

    def future(meta, ids, logp):
        meta["policy_version"] = 7

    def truncated(meta, ids, logp):
        return encode(ids, logp, meta)[:-100]

    def oversized(meta, ids, logp):
        meta["prompt_index"] = meta["prompt_index"] * 2
        meta["prompt_sha256"] = meta["prompt_sha256"] * 2
        meta["rewards"] = meta["rewards"] * 2
        ids.extend([list(c) for c in ids])
        return encode(ids, torch.cat([logp, logp]), meta)

    def other_run(meta, ids, logp):
        meta["run"] = "someone-else"

    def logp_shifted(meta, ids, logp):
        logp.sub_(0.5)

    lies = {"forger": (rewards_flipped, "forged"), "impostor": (other_model, "sampled from another model"), "time-traveller": (future, "never published"),
            "torn": (truncated, "truncated"), "greedy": (oversized, "should be"), "stranger": (other_run, "for run someone-else"), "liar": (logp_shifted, "made up")}
    keys = {name: forged(run, honest[0], name, 0, change) for name, (change, _) in lies.items()}
    spam = [forged(run, honest[1], "spammer", i, rewards_flipped) for i in range(4)]  # max_rejections 3: the 4th is never read

    cfg = load_config(sets=[*FAST, *STORE], steps=4)
    train(run, "p00", "grpo", "rl", cfg, None, show_progress=False, rewards=[REWARD])
    state = json.loads(run.store.read(sorted(o.key for o in run.store.list("work/p00") if o.key.endswith("final/provenance.json"))[0]))  # the run finished
    assert state["steps"] == 4
    steps = metrics(run, "p00")
    assert sum(m["store_batches"] for m in steps) == 3  # the honest ones, each once
    assert sum(m["own_batches"] for m in steps) == 1  # then the trainer sampled itself: training went on
    assert sum(m["rejected_batches"] for m in steps) == len(lies) + 3
    records = {o.key: json.loads(run.store.read(o.key)) for o in run.store.list("rollouts/p00/rejected")}
    by_key = {r["key"]: r for r in records.values()}
    for name, (_, reason) in lies.items():
        assert reason in by_key[keys[name]]["reason"], (name, by_key[keys[name]]["reason"])
        assert by_key[keys[name]]["worker"] == name
    assert [k in by_key for k in spam] == [True, True, True, False] and by_key[spam[2]]["ignored"]


def test_async_bad_input(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
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
    publish(run, "p01", 0, model, max_async=10, step=0)
    rollout_worker(run, "p01", "rl", settings(), [load_reward(REWARD)], worker="other", batches=1, wait=5)
    key = run.store.list("rollouts/p01/batches")[0].key
    lie = decode(run.store.read(key), key, 1 << 30)
    run.store.write(key, encode(lie.completion_ids, lie.behaviour_logp_NC, {**lie.meta, "rewards": [5.0] * len(lie.completion_ids)}))  # what they state is never used
    worker(run, 3, "own")
    cfg = load_config(sets=[*FAST, *STORE, "external=2"], steps=3)
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
