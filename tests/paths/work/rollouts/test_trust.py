"""Rollouts nobody has to trust: every attack a worker with an admitted key, or anyone who can write
to the bucket, can make through the bucket alone. Each is rejected, nothing of it is learned (the
final weights are bitwise those of a run that never saw it), and honest workers pay nothing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from paths.train_config import load_config
from paths.work.grpo import sample_and_score
from paths.work.rewards import load_reward
from paths.work.rollouts import batch_key, decode, encode, read_allowlist, revoke
from paths.work.train import train
from storage.layout import open_run
from tests.paths.work.conftest import FAST, metrics, prompt_run
from tests.paths.work.rollouts.conftest import REWARD, STORE, final, forge, keyed, rejections, settings, start, worker

CHECK_ALL = "verify_rows=32"  # every row seed-checked: a forged row is found for certain (the sampling odds are tested in test_verify.py)


def moved(meta, completions, model, tokenizer, prompts):
    """Each group's completions handed to the next prompt of the batch."""
    g = 8
    groups = [completions[i : i + g] for i in range(0, len(completions), g)]
    completions[:] = [c for group in groups[1:] + groups[:1] for c in group]


def edited(meta, completions, model, tokenizer, prompts):
    """The last token before EOS (the answer's last digit) of every row replaced; a row that is EOS
    alone gets a digit before it (still a well-formed completion: only the seed check can tell)."""
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    for c in completions:
        if len(c) == 1 and c[0] == tokenizer.eos_token_id:
            c.insert(0, digits[0])
            continue
        t = max(0, len(c) - 2)
        c[t] = next(d for d in digits if d != c[t])


def best_of_4(meta, completions, model, tokenizer, prompts):
    """For each prompt, 4 groups sampled with the worker's own fresh randomness, the best-rewarded
    completions kept (true log-probs are recomputed by forge: only their choice is a lie)."""
    cfg = settings()
    records = [prompts[i] for i in meta["prompt_index"]]
    torch.manual_seed(123)
    tries = [sample_and_score(model, records, [load_reward(REWARD)], cfg, tokenizer) for _ in range(4)]
    best = [max(range(4), key=lambda k: tries[k].rewards[r]) for r in range(len(completions))]
    completions[:] = [tries[k].completion_ids[r] for r, k in enumerate(best)]


def honest_and_attacked(tmp_path, tokenizer_dir):
    """A run with policy version 0 and 3 honest signed batches; an identical copy to attack."""
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    worker(run, 3, keyed(run, tmp_path, "honest"))
    shutil.copytree(run.url, str(tmp_path / "attacked"))
    return run, open_run(str(tmp_path / "attacked"))


def test_attacks_are_rejected_and_nothing_of_them_is_learned(tmp_path, tokenizer_dir):
    clean, run = honest_and_attacked(tmp_path, tokenizer_dir)
    honest = sorted(o.key for o in run.store.list("rollouts/p00/batches/honest"))
    first = decode(run.store.read(honest[0]), honest[0], 1 << 30)
    attacks: dict[str, tuple[str, str]] = {}  # what -> (batch key, expected reason)

    # replay: the honest worker's batch copied verbatim under another number of its folder, and
    # under an admitted attacker's folder; re-signed by the attacker as its own
    replayed = batch_key(run, "p00", "honest", 3)
    run.store.write(replayed, run.store.read(honest[0]))
    attacks["replay, copied"] = (replayed, "a copy of the batch at position 0")
    run.store.write("rollouts/p00/batches/honest/0000007.safetensors", run.store.read(honest[1]))  # another spelling of a number: a copy all the same
    attacks["replay, another spelling"] = ("rollouts/p00/batches/honest/0000007.safetensors", "a copy of the batch at position 1")
    for odd in ("3.safetensors", "00000\u00b2.safetensors", "\u0660\u0660\u0660\u0660\u0660\u0663.safetensors"):  # not batch names: never read
        run.store.write(f"rollouts/p00/batches/honest/{odd}", run.store.read(honest[0]))
    mallory = keyed(run, tmp_path, "mallory")
    attacks["replay, re-signed"] = (forge(run, tmp_path, "mallory", mallory, 0, lambda m, c, *_: c.__setitem__(slice(None), first.completion_ids) or m.update(prompt_index=first.meta["prompt_index"], prompt_sha256=first.meta["prompt_sha256"])), "chosen prompts")
    # completions moved between prompts, an answer token edited, best-of-4 with true log-probs
    for name, change, reason in [("moved", moved, "is not what its seed draws"), ("edited", edited, "is not what its seed draws"), ("best-of-4", best_of_4, "is not what its seed draws")]:
        attacks[name] = (forge(run, tmp_path, name, keyed(run, tmp_path, name), 0, change), reason)
    # forged rewards (the signer's own lie), and a future policy version
    liar = keyed(run, tmp_path, "liar")
    k = forge(run, tmp_path, "liar", liar, 0, lambda *a: None)
    b = decode(run.store.read(k), k, 1 << 30)
    run.store.write(k, encode(b.completion_ids, b.behaviour_logp_NC, {**b.meta, "rewards": [1.0 - r for r in b.meta["rewards"]]}, liar))
    attacks["forged rewards"] = (k, "stated rewards differ")
    # impersonation: batches in the honest worker's folder signed by mallory, or not signed at all
    run.store.write(batch_key(run, "p00", "honest", 4), encode(b.completion_ids, b.behaviour_logp_NC, {**b.meta, "worker": "honest", "batch": 4}, mallory))
    run.store.write(batch_key(run, "p00", "honest", 5), encode(b.completion_ids, b.behaviour_logp_NC, {**b.meta, "worker": "honest", "batch": 5}))
    attacks["impersonation, signed by another key"] = (batch_key(run, "p00", "honest", 4), "impersonation")
    attacks["impersonation, unsigned"] = (batch_key(run, "p00", "honest", 5), "impersonation")
    # a torn object, and a batch in a folder nobody admitted (never read)
    run.store.write(batch_key(run, "p00", "liar", 1), run.store.read(k)[:-100])
    attacks["torn"] = (batch_key(run, "p00", "liar", 1), "truncated")
    run.store.write(batch_key(run, "p00", "stranger", 0), run.store.read(honest[1]))
    # skipping a place of one's chain: position 0 replaced by junk, position 1 honest: it waits for ever
    skipper = keyed(run, tmp_path, "skipper")
    worker(run, 2, skipper)
    run.store.write(batch_key(run, "p00", "skipper", 0), b"\x10" + b"\x00" * 7 + b"[" * 16)
    attacks["skipped by junk"] = (batch_key(run, "p00", "skipper", 0), "metadata")
    # hostile bytes from anyone: a deeply nested header, tensors of another dtype under honest metadata
    deep = b"[" * 20000
    run.store.write(batch_key(run, "p00", "honest", 6), len(deep).to_bytes(8, "little") + deep)
    from safetensors.torch import save

    run.store.write(batch_key(run, "p00", "honest", 8), save({"completion_ids": torch.zeros(2, 2, dtype=torch.bfloat16), "behaviour_logp": torch.zeros(2, 2)},
                                                             metadata={"paths": json.dumps(first.meta)}))
    attacks["nested header"] = (batch_key(run, "p00", "honest", 6), "metadata")
    attacks["odd tensors"] = (batch_key(run, "p00", "honest", 8), "want (N, C) int64 and float32")

    cfg = load_config(sets=[*FAST, *STORE, CHECK_ALL], steps=4)
    for r in (clean, run):
        train(r, "p00", "grpo", "rl", cfg, None, show_progress=False, rewards=[REWARD])
    a, b = final(clean), final(run)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise: nothing of any attack was learned
    steps = metrics(run, "p00")
    assert sum(m["store_batches"] for m in steps) == 3 and sum(m["own_batches"] for m in steps) == 1  # the honest ones, each once; then training went on
    records = rejections(run)
    for what, (key, reason) in attacks.items():
        assert reason in records[key]["reason"], (what, records[key]["reason"])
    assert not any(k.startswith("rollouts/p00/batches/stranger") or k.endswith(("/3.safetensors", "\u00b2.safetensors", "\u0663.safetensors")) for k in records)  # never read
    assert batch_key(run, "p00", "skipper", 1) not in records and batch_key(run, "p00", "skipper", 1) not in json.dumps(steps)  # waits: never taken
    strikes = {r["worker"]: r["attributed"] for r in records.values() if r["attributed"]}
    assert "honest" not in strikes  # nobody got the honest worker struck by writing under its name
    assert {"mallory", "moved", "edited", "best-of-4", "liar"} <= set(strikes)


def test_spam_costs_the_sender_and_reads_are_bounded(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    worker(run, 2, keyed(run, tmp_path, "honest"))
    spammer = keyed(run, tmp_path, "spammer")
    k = forge(run, tmp_path, "spammer", spammer, 0, lambda *a: None)
    b = decode(run.store.read(k), k, 1 << 30)
    for i in range(10):  # signed stale-by-checksum spam for the first place of its chain: each one a strike, then never read again
        run.store.write(batch_key(run, "p00", "spammer", i), encode(b.completion_ids, b.behaviour_logp_NC, {**b.meta, "policy_sha256": f"{i:064x}"}, spammer))
    for i in range(2, 40):  # junk nobody signed in the honest worker's folder: only its read budget pays
        run.store.write(batch_key(run, "p00", "honest", i), b"junk %d" % i)
    cfg = load_config(sets=[*FAST, *STORE, "rollout_reads=5"], steps=2)
    train(run, "p00", "grpo", "rl", cfg, None, show_progress=False, rewards=[REWARD])
    records = rejections(run)
    spam = [r for r in records.values() if r["worker"] == "spammer"]
    assert len(spam) == 3 and all(r["attributed"] and "never published" in r["reason"] for r in spam) and spam[-1]["ignored"]
    junk = [r for r in records.values() if r["worker"] == "honest"]
    assert len(junk) == 3 + 5 and not any(r["attributed"] for r in junk)  # 5 reads a step: the 2 honest batches and 3 junk objects, then 5 junk objects
    assert [m["store_batches"] for m in metrics(run, "p00")] == [1, 1]


def test_a_revoked_key_is_not_heard(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    worker(run, 2, keyed(run, tmp_path, "gone"))
    revoke(run, "gone")
    assert not read_allowlist(run).workers["gone"].active
    train(run, "p00", "grpo", "rl", load_config(sets=[*FAST, *STORE], steps=1), None, show_progress=False, rewards=[REWARD])
    assert metrics(run, "p00")[0]["own_batches"] == 1
    assert all("revoked" in r["reason"] and not r["attributed"] for r in rejections(run).values())


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_honest_bf16_and_int8_workers_pass_every_check(dtype, tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    worker(run, 2, keyed(run, tmp_path, "w"), dtype=dtype)
    train(run, "p00", "grpo", "rl", load_config(sets=[*FAST, *STORE, CHECK_ALL, "rollout_dtypes=fp32,bf16,int8"], steps=2), None, show_progress=False, rewards=[REWARD])
    steps = metrics(run, "p00")
    assert [m["store_batches"] for m in steps] == [1, 1] and not run.store.list("rollouts/p00/rejected")
    assert all(m["verified_rows"] == 32 for m in steps)
    assert json.loads(run.store.read("policy/p00/latest.json"))["nonce"]


def test_chains_survive_squatters_and_restarts_and_catch_equivocation(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    key = keyed(run, tmp_path, "honest")
    worker(run, 2, key)
    run.store.write(batch_key(run, "p00", "honest", 2), b"squatted")  # someone takes the next object number
    assert worker(run, 2, key)["batches"] == 2  # restarted: goes on from its chain's head, under the next free numbers
    positions = [decode(run.store.read(batch_key(run, "p00", "honest", n)), "", 1 << 30).position for n in (0, 1, 3, 4)]
    assert positions == [0, 1, 2, 3]
    twice = keyed(run, tmp_path, "twice")
    worker(run, 1, twice)
    b = decode(run.store.read(batch_key(run, "p00", "twice", 0)), "", 1 << 30)
    run.store.write(batch_key(run, "p00", "twice", 1), encode(b.completion_ids, b.behaviour_logp_NC, {**b.meta, "at": 0.0}, twice))  # a second batch for position 0
    train(run, "p00", "grpo", "rl", load_config(sets=[*FAST, *STORE], steps=6), None, show_progress=False, rewards=[REWARD])
    assert [m["store_batches"] for m in metrics(run, "p00")] == [1, 1, 1, 1, 1, 0]  # all four of the honest chain, and one of the two
    records = rejections(run)
    assert records[batch_key(run, "p00", "twice", 1)]["attributed"] and "a second, different batch for position 0" in records[batch_key(run, "p00", "twice", 1)]["reason"]
    assert not records[batch_key(run, "p00", "honest", 2)]["attributed"]
