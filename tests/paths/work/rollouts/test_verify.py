"""The pieces of the trainer's checks: how many rows, seeded sampling that any chunking reproduces,
the row hashes that keep a row from being learned twice, and malformed completions."""

from __future__ import annotations

import json
import random

import pytest
import torch

from paths.work.rewards import load_reward
from paths.work.rollouts import decode, detection_probability, encode, rows_to_verify
from paths.work.rollouts.batch import Rejected
from paths.work.rollouts.seeds import batch_seed, pick_prompts, row_uniforms
from paths.work.rollouts.source import StoreRollouts
from paths.work.sampling import complete
from sharding.dataset import read_prompts
from tests.paths.work.conftest import loaded, prompt_run
from tests.paths.work.rollouts.conftest import REWARD, SALT, keyed, settings, start, worker


@pytest.mark.parametrize("n", [16, 32, 64, 256])
def test_rows_to_verify_meets_the_goal_with_the_fewest_rows(n):
    k = rows_to_verify(n, 0.25, 0.99)
    assert detection_probability(n, k, 0.25) >= 0.99 > detection_probability(n, k - 1, 0.25)
    forged, rng, trials = set(range(n // 4)), random.Random(0), 20000  # the trainer's pick, simulated
    caught = sum(bool(forged & set(rng.sample(range(n), k))) for _ in range(trials)) / trials
    assert abs(caught - detection_probability(n, k, 0.25)) < 0.01
    assert rows_to_verify(n, 0.25, 0.99, rows=5) == 5 and rows_to_verify(4, 0.25, 0.99, rows=9) == 4


def test_seeded_sampling_does_not_depend_on_chunking(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    model, tokenizer = loaded(run, tmp_path)
    records = read_prompts(run, "rl", "p00")[:4]
    seed = batch_seed("ab" * 16, "w", "", 0)
    u = row_uniforms(seed, 32, 8)
    assert u.dtype == torch.float32 and 0 <= float(u.min()) and float(u.max()) < 1
    assert torch.equal(row_uniforms(seed, [30, 3, 7], 8), u[[30, 3, 7]])  # the seed check's rows alone: the same numbers
    torch.manual_seed(1)
    whole = complete(model, records, 8, tokenizer, max_new_tokens=8, temperature=1.0, chunk=32, uniforms=u)
    torch.manual_seed(2)  # torch's generator plays no part
    by_group = complete(model, records, 8, tokenizer, max_new_tokens=8, temperature=1.0, chunk=8, uniforms=u)
    by_row = complete(model, records, 8, tokenizer, max_new_tokens=8, temperature=1.0, chunk=4, uniforms=u)
    assert whole == by_group == by_row
    other = complete(model, records, 8, tokenizer, max_new_tokens=8, temperature=1.0, chunk=32, uniforms=row_uniforms(batch_seed("ab" * 16, "w", "", 1), 32, 8))
    assert other != whole
    assert pick_prompts(seed, 4, 100) == pick_prompts(seed, 4, 100) != pick_prompts(batch_seed("ab" * 16, "w", "", 1), 4, 100)


def source(run, tmp_path, *extra):
    model, tokenizer = loaded(run, tmp_path)
    return StoreRollouts(run, "p00", "rl", settings(*extra), read_prompts(run, "rl", "p00"), [load_reward(REWARD)], tokenizer, lambda: loaded(run, tmp_path)[0])


def test_a_row_is_never_learned_twice_and_malformed_rows_are_refused(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    key = keyed(run, tmp_path, "w")
    worker(run, 1, key)
    src = source(run, tmp_path, "verify_rows=32")
    k = run.store.list("rollouts/p00/batches/w")[0].key
    batch = decode(run.store.read(k), k, 1 << 30)
    record = json.loads(run.store.read("policy/p00/v00000000/policy.json"))
    seen: set[str] = set()
    verified = src.verifier.verify(batch, record, seen.__contains__)
    assert verified.check.rows == 32 and verified.check.positions == sum(len(c) for c in batch.completion_ids) and verified.check.near == 0
    seen.update(verified.rows)
    with pytest.raises(Rejected, match="replay"):
        src.verifier.verify(batch, record, seen.__contains__)
    eos = src.tokenizer.eos_token_id
    for change, reason in [(lambda c: c.__setitem__(slice(None), [c[0], eos, c[0], eos]), "goes on after EOS"),
                           (lambda c: c.__setitem__(slice(None), [c[0]]) if c[0] != eos else c.__setitem__(slice(None), [5]), "without EOS")]:
        bad = [list(c) for c in batch.completion_ids]
        change(bad[3])
        forged = decode(encode(bad, batch.behaviour_logp_NC, batch.meta, key), k, 1 << 30)
        with pytest.raises(Rejected, match=reason):
            src.verifier.verify(forged, record, lambda h: False)


def test_a_trainer_takes_only_the_dtypes_it_allows(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    worker(run, 1, keyed(run, tmp_path, "w"), dtype="int8")
    k = run.store.list("rollouts/p00/batches/w")[0].key
    batch = decode(run.store.read(k), k, 1 << 30)
    record = json.loads(run.store.read("policy/p00/v00000000/policy.json"))
    assert source(run, tmp_path, "rollout_dtypes=fp32,int8").verifier.verify(batch, record, lambda h: False).check.rows == 13
    with pytest.raises(Rejected, match="this trainer takes fp32,bf16"):  # int8 is loosely checked: taken only when asked for
        source(run, tmp_path).verifier.verify(batch, record, lambda h: False)
    with pytest.raises(Exception, match="rollout_dtypes must be"):
        settings("rollout_dtypes=fp64")


def test_the_seed_check_runs_a_groups_prompt_once_and_sees_what_a_pass_per_row_sees(tmp_path, tokenizer_dir, monkeypatch):
    from paths.work import grpo
    from paths.work.rollouts.verify import position_misses

    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    worker(run, 1, keyed(run, tmp_path, "w"))
    src = source(run, tmp_path)
    k = run.store.list("rollouts/p00/batches/w")[0].key
    batch = decode(run.store.read(k), k, 1 << 30)
    record = json.loads(run.store.read("policy/p00/v00000000/policy.json"))
    cfg, group = src.cfg, src.cfg.group_size
    records = [src.records[i] for i in batch.meta["prompt_index"]]
    rows = sorted(random.Random(0).sample(range(len(batch.completion_ids)), 12))
    assert len({r // group for r in rows}) < len(rows)  # some rows share their group's prompt
    shared = []
    real = grpo.shared_prompt_logits
    monkeypatch.setattr(grpo, "shared_prompt_logits", lambda *a: shared.append(real(*a)) or shared[-1])

    def misses(share: bool) -> list[torch.Tensor]:
        u = row_uniforms(batch_seed(record["nonce"], "w", batch.meta["key"], batch.position), len(batch.completion_ids), cfg.max_new_tokens)
        found = position_misses(src.verifier.model(0, "fp32"), [records[r // group] for r in rows], [batch.completion_ids[r] for r in rows], u[rows],
                                batch.behaviour_logp_NC[rows], cfg.temperature, cfg.top_p, src.tokenizer.pad_token_id, share_prompts=share)
        return [torch.stack([m, i.float(), g]) for m, i, g in found]

    one_pass_per_row = misses(False)
    assert shared == []
    both = misses(True)
    assert shared and all(s is not None for s in shared)  # the prompts did run once per group
    assert len(both) == len(one_pass_per_row) == len(rows)
    for a, b in zip(both, one_pass_per_row):
        torch.testing.assert_close(a, b, atol=1e-8, rtol=1e-5)  # probabilities near 1 / vocabulary: a wrong position moves them more
    assert src.verifier.verify(batch, record, lambda h: False).check.near == 0  # the trainer's own check shares them (share_prompts is on)


def test_the_checks_load_a_version_the_trainer_published_from_its_memory(tmp_path, tokenizer_dir, monkeypatch):
    """A version this trainer published is checked from the tensors it kept (no read back, no
    hashing); one whose sha256 differs from the record's, or one it did not keep, is read from the
    store and checked as before; either way the same seed check."""
    from paths.work.rollouts import policy as policy_module
    from paths.work.rollouts.versions import weights

    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    worker(run, 1, keyed(run, tmp_path, "w"))
    k = run.store.list("rollouts/p00/batches/w")[0].key
    batch = decode(run.store.read(k), k, 1 << 30)
    record = json.loads(run.store.read("policy/p00/v00000000/policy.json"))
    reads = []
    real = policy_module.read_tensors
    monkeypatch.setattr(policy_module, "read_tensors", lambda *a, **kw: reads.append(a[1]) or real(*a, **kw))

    from_store = source(run, tmp_path, "verify_rows=64")
    checked = from_store.verifier.verify(batch, record, lambda h: False).check
    assert len(reads) == 1
    kept = source(run, tmp_path, "verify_rows=64")
    kept.published(record, weights(loaded(run, tmp_path)[0]))
    assert kept.verifier.verify(batch, record, lambda h: False).check == checked and len(reads) == 1  # from memory: nothing read
    wrong = source(run, tmp_path, "verify_rows=64")
    other = {n: t + 1 for n, t in weights(loaded(run, tmp_path)[0]).items()}
    wrong.published({**record, "sha256": "0" * 64}, other)  # not the version the record names: never used
    assert wrong.verifier.verify(batch, record, lambda h: False).check == checked and len(reads) == 2
    few = source(run, tmp_path, "max_async=2")
    for v in range(5):  # only the newest max_async + 1 versions stay
        few.published({**record, "version": v}, weights(loaded(run, tmp_path)[0]))
    assert sorted(few.verifier._own) == [2, 3, 4]


def test_a_delta_version_is_checked_from_what_the_writer_rebuilt(tmp_path, tokenizer_dir, monkeypatch):
    """Between snapshots a version is a delta: the tensors the trainer keeps for it are the ones
    a worker rebuilds (its sha256's), not the trainer's exact weights, and the checks load them
    without reading the snapshot and the delta back."""
    from paths.work.rollouts import policy as policy_module
    from paths.work.rollouts.policy import VersionWriter
    from paths.work.rollouts.versions import state_digest, weights

    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    model, _ = loaded(run, tmp_path)
    writer = VersionWriter(run, "p00", SALT, snapshot_every=4)
    src = source(run, tmp_path)
    for version in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
        record = writer.publish(version, model)
        src.published(record, writer.state)
    assert record["kind"] == "delta" and state_digest(writer.state) == record["sha256"] != state_digest(weights(model))
    reads = []
    real = policy_module.read_tensors
    monkeypatch.setattr(policy_module, "read_tensors", lambda *a, **kw: reads.append(a[1]) or real(*a, **kw))
    checked = src.verifier.model(1, "fp32", record)
    assert reads == [] and state_digest(weights(checked)) == record["sha256"]
