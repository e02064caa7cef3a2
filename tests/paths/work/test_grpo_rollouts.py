"""GRPO rollouts: every step has signal (dynamic sampling, overlong shaping, a warning when none),
record fields reach the rewards, log-prob passes stay one micro-batch wide whatever grad_accum,
the GRPO preset, bad input, rejection sampling, and a few steps on CUDA (marked gpu)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from paths.errors import ConfigurationError, DataError
from paths.train_config import load_config
from paths.units import decomposed_paths
from paths.work.grpo import GRPOStep, overlong_penalty, reduce_loss, rollout
from paths.work.rewards import load_reward
from paths.work.sampling import check_prompts
from paths.work.train import train
from sharding.dataset import read_prompts
from sharding.shard import ShardOptions, shard
from tests.paths.work.conftest import FAST, loaded, metrics, prompt_run

TOYS = "tests.paths.toy_rewards"


@pytest.fixture
def rl_run(tmp_path, tokenizer_dir):
    """200 arithmetic prompts routed by hash, 20% held out, with their ids."""
    return prompt_run(tmp_path, tokenizer_dir, holdout=0.2, id_field="id")


# -- normalisation and shaping by hand -----------------------------------------------------------------
def test_bnpo_is_per_micro_batch_and_dapo_over_the_step():
    """Two micro-batches of 1 and 3 tokens: bnpo averages each micro-batch's token mean (TRL);
    dapo divides the step's token sum by the step's 4 tokens."""
    a, ma = torch.tensor([[2.0, 0.0]]), torch.tensor([[1.0, 0.0]])
    b, mb = torch.tensor([[1.0, 1.0, 4.0]]), torch.tensor([[1.0, 1.0, 1.0]])
    bnpo = reduce_loss(a, ma, "bnpo", 2, 4, 3, micro_batches=2) + reduce_loss(b, mb, "bnpo", 2, 4, 3, micro_batches=2)
    dapo = reduce_loss(a, ma, "dapo", 2, 4, 3, micro_batches=2) + reduce_loss(b, mb, "dapo", 2, 4, 3, micro_batches=2)
    assert bnpo.item() == pytest.approx((2.0 + 6.0 / 3) / 2) and dapo.item() == pytest.approx(8.0 / 4)


def test_soft_overlong_punishment_by_hand():
    assert overlong_penalty([10, 12, 14, 16], 16, 4) == [0.0, 0.0, -0.5, -1.0]


def test_overlong_mask_leaves_cut_completions_out_of_the_loss(rl_run, tmp_path):
    model, tok = loaded(rl_run, tmp_path)
    cfg = load_config(sets=FAST + ["overlong=mask"], steps=1)
    ro = rollout(model, None, read_prompts(rl_run, "rl", "p00")[:4], [load_reward(f"{TOYS}:even_first_char")], cfg, tok)
    assert ro.truncated_N.any()  # an untrained model rarely ends within 4 tokens
    assert torch.equal(ro.loss_mask_NC.sum(1) > 0, ~ro.truncated_N)
    assert torch.equal(ro.loss_mask_NC[~ro.truncated_N], ro.completion_mask_NC[~ro.truncated_N])


# -- every step has signal --------------------------------------------------------------------------
def test_dynamic_sampling_trains_only_on_groups_with_signal(rl_run):
    """The reward reads the record's `level` field (TRL's keyword convention) and is constant on
    level-2 prompts: those groups are dropped and more prompts drawn until the batch is full."""
    cfg = load_config(sets=FAST + ["dynamic_sampling=true", "max_sampling_rounds=8", "eval_every=2", "eval_prompts=8"], steps=4)
    train(rl_run, "p00", "grpo", "rl", cfg, None, show_progress=False, rewards=[f"{TOYS}:level_one_only"])
    ms = metrics(rl_run, "p00")
    assert all(m["zero_variance_groups"] == 0 for m in ms), [m["zero_variance_groups"] for m in ms]
    assert sum(m["dropped_groups"] for m in ms) > 0 and all(m["sampling_rounds"] >= 1 for m in ms)
    assert "heldout_reward" in ms[1] and "heldout_reward" in ms[3] and "heldout_reward" not in ms[0]
    for key in ("entropy", "clip_low", "clip_high", "truncated", "completion_length_min", "completion_length_max", "kl"):
        assert key in ms[-1], key


def test_dynamic_sampling_that_cannot_fill_names_the_dataset(rl_run):
    cfg = load_config(sets=FAST + ["dynamic_sampling=true", "max_sampling_rounds=2"], steps=2)
    with pytest.raises(DataError, match=r"found 0 of 4 prompt groups with signal in 2 rounds \(8 prompts\) of dataset 'rl'"):
        train(rl_run, "p00", "grpo", "rl", cfg, None, show_progress=False, rewards=[f"{TOYS}:always_one"])
    assert not rl_run.store.exists("work/p00/final/manifest.json") and rl_run.checkpoints("p00") == []


def test_a_step_without_signal_warns(rl_run, caplog):
    with caplog.at_level(logging.WARNING, logger="paths.grpo"):
        train(rl_run, "p00", "grpo", "rl", load_config(sets=FAST, steps=1), None, show_progress=False, rewards=[f"{TOYS}:always_one"])
    assert "no group of rollout 1 had reward variance" in caplog.text
    assert metrics(rl_run, "p00")[0]["zero_variance_groups"] == 1.0


def test_a_reward_that_returns_only_none_stops_training(rl_run):
    with pytest.raises(DataError, match=f"reward '{TOYS}:never_applies' returned only None"):
        train(rl_run, "p00", "grpo", "rl", load_config(sets=FAST, steps=1), None, show_progress=False, rewards=[f"{TOYS}:never_applies"])


# -- memory: one micro-batch at a time -----------------------------------------------------------------
def test_forward_passes_stay_one_micro_batch_wide_whatever_grad_accum(rl_run, tmp_path):
    """grad_accum 4 x 2 prompts x G 4: sampling runs generation_batch_size rows at a time, every
    log-prob pass (old, reference, policy) one micro-batch of 8 rows with completion logits only."""
    from accelerate import Accelerator

    model, tok = loaded(rl_run, tmp_path)
    ref, _ = loaded(rl_run, tmp_path)
    cfg = load_config(sets=["batch_size=2", "group_size=4", "grad_accum=4", "max_new_tokens=6", "iterations=2", "beta=0.1", "generation_batch_size=4", "share_prompts=false"], steps=1)  # every row one pass (shared: below)
    seen: list[tuple[int, int, int]] = []
    for m in (model, ref):
        m.register_forward_hook(lambda mod, args, kwargs, out: seen.append((kwargs["input_ids"].shape[0], kwargs["input_ids"].shape[1], out.logits.shape[1])), with_kwargs=True)
    records = read_prompts(rl_run, "rl", "p00")
    batches = iter([{"index": torch.arange(i, i + 2)} for i in range(0, 16, 2)])
    acc = Accelerator(cpu=True)
    GRPOStep(cfg, records, [load_reward(f"{TOYS}:even_first_char")], tok, ref.eval(), "rl")(model, acc, batches)
    generation = [s for s in seen if s[2] == 1]
    logprob = [s for s in seen if s[2] > 1]
    assert generation and max(rows for rows, _, _ in generation) <= 4
    assert len(logprob) == 3 * 4  # old, reference and policy passes over 4 micro-batches
    assert all(rows == 8 and keep <= cfg.max_new_tokens + 1 < width for rows, width, keep in logprob)


def test_shared_prompt_passes_stay_one_micro_batch_wide_too(rl_run, tmp_path):
    """The same step with share_prompts (the default): each log-prob pass is a pass over the
    micro-batch's 2 distinct prompts (the first completion logit only), then one over its 8 rows
    on their cache (completion logits only)."""
    from accelerate import Accelerator

    model, tok = loaded(rl_run, tmp_path)
    ref, _ = loaded(rl_run, tmp_path)
    cfg = load_config(sets=["batch_size=2", "group_size=4", "grad_accum=4", "max_new_tokens=6", "iterations=2", "beta=0.1", "generation_batch_size=4"], steps=1)
    seen: list[tuple[int, int, int]] = []
    for m in (model, ref):
        m.register_forward_hook(lambda mod, args, kwargs, out: seen.append((kwargs["input_ids"].shape[0], kwargs["input_ids"].shape[1], out.logits.shape[1]))
                                if not torch.is_inference_mode_enabled() else None, with_kwargs=True)  # sampling runs in inference mode
    batches = iter([{"index": torch.arange(i, i + 2)} for i in range(0, 16, 2)])
    GRPOStep(cfg, read_prompts(rl_run, "rl", "p00"), [load_reward(f"{TOYS}:even_first_char")], tok, ref.eval(), "rl")(model, Accelerator(cpu=True), batches)
    assert len(seen) == 2 * 3 * 4  # old, reference and policy passes over 4 micro-batches, two forwards each
    prompts, completions = seen[::2], seen[1::2]
    assert all(rows == 2 and keep == 1 for rows, _, keep in prompts)
    assert all(rows == 8 and width == keep <= cfg.max_new_tokens - 1 for rows, width, keep in completions)  # the completions but their last token: no prompt column


# -- settings and bad input --------------------------------------------------------------------------
def test_the_grpo_preset_and_its_overrides():
    cfg = load_config(mode="grpo")
    assert (cfg.lr, cfg.weight_decay, cfg.epsilon_high, cfg.loss, cfg.min_lr_ratio) == (1e-6, 0.0, 0.28, "dapo", 1.0)
    assert load_config(mode="grpo", sets=["lr=1e-4"]).lr == 1e-4 and load_config().lr == 3e-4  # lm keeps the defaults
    assert load_config(mode="grpo", sets=["dynamic_sampling=on"]).dynamic_sampling is True


@pytest.mark.parametrize("sets, message", [
    (["generation_batch_size=3"], "generation_batch_size 3 does not divide the rollout of 64"),
    (["overlong=soft"], "needs 0 < overlong_buffer <= max_new_tokens"),
    (["dynamic_sampling=maybe"], "expected a bool"),
    (["overlong=cut"], "overlong must be none, mask"),
])
def test_bad_grpo_settings(sets, message):
    with pytest.raises(ConfigurationError, match=message):
        load_config(sets=sets)


def test_prompts_too_long_and_gold_answers_that_do_not_parse_are_refused(rl_run, tmp_path):
    records = read_prompts(rl_run, "rl", "p00")
    with pytest.raises(DataError, match=f"prompt '{records[0]['id']}' has {len(records[0]['ids'])} tokens"):
        check_prompts(records, [], "rl", context=len(records[0]["ids"]) + 3, max_new_tokens=4)
    f = tmp_path / "bad.jsonl"
    f.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"what is {i}?", "answer": "twelve" if i == 7 else str(i)}) + "\n" for i in range(40)))
    shard(rl_run, ShardOptions(dataset="bad", inputs=[str(f)], kind="prompts", text_field="prompt", id_field="id", router="hash", holdout=0.0))
    path = next(p for p in decomposed_paths(rl_run)[1] if any(r["id"] == "q7" for r in read_prompts(rl_run, "bad", p)))
    with pytest.raises(DataError, match="record 'q7' has gold answer 'twelve' that reward 'math_answer' cannot parse"):
        train(rl_run, path, "grpo", "bad", load_config(sets=FAST, steps=1), None, show_progress=False, rewards=["math_answer"])
    assert rl_run.checkpoints(path) == []


def test_group_size_1_is_one_line_and_exit_1(rl_run, tmp_path, monkeypatch):
    monkeypatch.setenv("PATHS_HOME", str(tmp_path / "home"))
    r = CliRunner().invoke(main, ["train", rl_run.url, "--path", "p00", "--mode", "grpo", "--dataset", "rl", "--group-size", "1"])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "--group-size must be >= 2" in r.stderr


# -- rejection sampling --------------------------------------------------------------------------------
def test_rejection_sampling_keeps_what_the_verifier_accepts_and_feeds_sft(rl_run, tmp_path):
    out = tmp_path / "accepted.jsonl"
    r = CliRunner().invoke(main, ["rejection-sample", rl_run.url, "--model", "base", "--shard", "p00", "--dataset", "rl", "--n", "4", "--keep", "2", "--max-new-tokens", "4",
                                  "--reward", f"{TOYS}:even_first_char", "--limit", "20", "--out", str(out), "--no-progress"])
    assert r.exit_code == 0, r.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows and all(r["reward"] == 1.0 for r in rows)
    assert all(r["completion"] and ord(r["completion"][0]) % 2 == 0 for r in rows)  # the verifier's rule, checked again
    by_prompt: dict[str, list[str]] = {}
    for row in rows:
        by_prompt.setdefault(row["prompt"], []).append(row["completion"])
    assert all(len(c) <= 2 and len(set(c)) == len(c) for c in by_prompt.values())  # --keep distinct completions
    assert {"gold", "level", "family"} <= rows[0].keys()
    shard(rl_run, ShardOptions(dataset="rs", inputs=[str(out)], kind="prompts", text_field="prompt", answer_field="completion", id_field="id", holdout=0.0))
    path = max(decomposed_paths(rl_run)[1], key=lambda p: len(read_prompts(rl_run, "rs", p)))
    summary = train(rl_run, path, "sft", "rs", load_config(sets=["seq_len=160", "batch_size=2", "checkpoint_every=0"], steps=2), None, show_progress=False)
    assert summary["steps"] == 2 and summary["tokens"] > 0


# -- distributed -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_gloo_ranks_sample_the_same_rounds_and_only_rank_0_writes(rl_run, tmp_path):
    """`accelerate launch`-style DDP on CPU: dynamic sampling agrees on its rounds across ranks, the
    reference model is prepared like the policy, every rank's data position is saved."""
    import os

    from tests.paths.work.test_train import cli

    home = str(tmp_path / "w")
    assert cli("claim", rl_run.url, "--path", "p00", home=home)[0] == 0
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(30500 + os.getpid() % 1000)}
    args = ["train", rl_run.url, "--mode", "grpo", "--dataset", "rl", "--reward", f"{TOYS}:level_one_only", "--steps", "5", "--checkpoint-every", "4", "--dynamic-sampling",
            "--beta", "0.1", "--no-progress", *(x for kv in ["batch_size=2", *FAST[1:4], "max_sampling_rounds=16", "lr=1e-3"] for x in ("--set", kv))]
    procs = [cli(*args, home=home, wait=False, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    state = json.loads(rl_run.store.read("work/p00/ckpt-4/state.json"))
    assert [d["rank"] for d in state["data"]] == [0, 1]  # the trainer checked both ranks drew the same batches
    ms = metrics(rl_run, "p00")
    assert len(ms) == 5 and all(m["zero_variance_groups"] == 0 for m in ms) and ms[-1]["kl"] > 0
    assert "trained p00" in results[0][0] and results[1][0] == ""


# -- CUDA ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_steps_on_cuda_in_bf16(rl_run, beta):
    """A few GRPO steps on one GPU, bf16 autocast, with and without the reference model."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = load_config(sets=FAST + ["lr=1e-3", f"beta={beta}", "precision=bf16", "dynamic_sampling=true", "max_sampling_rounds=8"], steps=4)
    summary = train(rl_run, "p00", "grpo", "rl", cfg, None, show_progress=False, rewards=[f"{TOYS}:even_first_char"])
    ms = metrics(rl_run, "p00")
    assert summary["steps"] == 4 and all(torch.isfinite(torch.tensor(m["loss"])) for m in ms)
    assert ms[0]["kl"] < 1e-3  # the reference runs exactly like the policy: no divergence before the first update
    assert (ms[-1]["kl"] > 0) == (beta > 0)
