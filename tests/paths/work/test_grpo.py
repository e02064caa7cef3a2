"""GRPO: each loss type against a hand-computed value, zero advantage for a zero-variance group,
a toy reward that a tiny model learns within 30 CPU steps, 4x1 accumulation equal to 1x4, exact
resume, the rewards and task generator, and bad input."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from paths.errors import ConfigurationError, DataError
from paths.work.grpo import clipped_surrogate, group_advantages, grpo_backward, kl_k3, reduce_loss, rollout
from paths.work.rewards import extract_answer, format_reward, load_reward, math_answer
from paths.work.tasks import arithmetic, write_jsonl
from paths.work.train import train
from paths.train_config import load_config
from sharding.shard import ShardOptions, shard
from tests.paths.work.conftest import FAST, loaded, metrics, prompt_run
from tests.sharding.conftest import make_run

TOY = "tests.paths.toy_rewards:even_first_char"


@pytest.fixture
def rl_run(tmp_path, tokenizer_dir):
    """200 arithmetic prompts routed by hash, none held out."""
    return prompt_run(tmp_path, tokenizer_dir, holdout=0.0)


# -- the pieces, by hand ----------------------------------------------------------------------------
def test_each_loss_type_equals_the_hand_computed_value():
    adv = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    logp = torch.zeros(2, 3)
    per_token, clipped = clipped_surrogate(logp, logp, adv, 0.2, 0.2)  # ratio 1: loss = -A
    assert torch.equal(per_token, torch.tensor([[-1.0, -1, -1], [0.5, 0.5, 0.5]])) and not clipped.any()
    # grpo: mean of per-sequence means = (-1 + 0.5) / 2
    assert reduce_loss(per_token, mask, "grpo", 2, 5, 3).item() == pytest.approx(-0.25)
    # bnpo / dapo: sum over tokens / tokens = (-2 + 1.5) / 5
    assert reduce_loss(per_token, mask, "bnpo", 2, 5, 3).item() == pytest.approx(-0.1)
    assert reduce_loss(per_token, mask, "dapo", 2, 5, 3).item() == pytest.approx(-0.1)
    # dr_grpo: sum / (completions x max_new_tokens) = -0.5 / 6
    assert reduce_loss(per_token, mask, "dr_grpo", 2, 5, 3).item() == pytest.approx(-0.5 / 6)


def test_clipping_and_kl_by_hand():
    logp, old = torch.log(torch.tensor([[1.5]])), torch.zeros(1, 1)
    loss, clipped = clipped_surrogate(logp, old, torch.tensor([1.0]), 0.2, 0.2)
    assert loss.item() == pytest.approx(-1.2) and clipped.item()  # min(1.5, 1.2) * 1
    loss, clipped = clipped_surrogate(logp, old, torch.tensor([-1.0]), 0.2, 0.2)
    assert loss.item() == pytest.approx(1.5) and not clipped.item()  # min(-1.5, -1.2)
    loss, _ = clipped_surrogate(logp, old, torch.tensor([1.0]), 0.2, 0.28)  # DAPO's clip-higher
    assert loss.item() == pytest.approx(-1.28)
    kl = kl_k3(torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25])))
    assert kl.item() == pytest.approx(0.5 - math.log(0.5) - 1)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_zero_variance_group_has_zero_advantage(scale):
    rewards = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1])
    adv = group_advantages(rewards, 4, scale)
    assert torch.equal(adv[:4], torch.zeros(4))
    assert adv[4:].abs().min() > 0 and adv[4:].sum().abs() < 1e-6
    if scale == "none":
        assert torch.allclose(adv[4:], torch.tensor([-0.5, 0.5, -0.5, 0.5]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_rewards_get_exactly_zero_advantage_even_when_their_mean_rounds(scale):
    rewards = torch.tensor([1.2] * 8 + [0.2] * 4 + [1.2] * 4)  # float32's mean of eight 1.2 is an ulp above 1.2
    adv = group_advantages(rewards, 8, scale)
    assert torch.equal(adv[:8], torch.zeros(8)) and adv[8:].abs().min() > 0


def short_rows(ro, lengths: list[int]):
    """The rollout with completion i cut to lengths[i] tokens (masks and attention), as if it had ended there."""
    c = ro.completion_mask_NC.shape[1]
    for i, n in enumerate(lengths):
        ro.completion_mask_NC[i, n:] = 0
        ro.loss_mask_NC[i, n:] = 0
        ro.attention_NT[i, ro.prompt_len + n :] = 0
    assert max(lengths) <= c
    return ro


def test_a_micro_batch_plan_covers_each_row_with_signal_once():
    from paths.work.grpo import Rollout, plan_micro_batches

    n, g = 32, 4
    adv = torch.arange(n, dtype=torch.float32) - 3
    adv[8:12] = 0  # one group without signal
    loss_mask = torch.ones(n, 10)
    loss_mask[5] = 0  # a row whose tokens are all out of the loss (cut at max_new_tokens under overlong=mask)
    lengths = torch.tensor([(7 * i) % 10 + 1 for i in range(n)])
    cmask = (torch.arange(10)[None] < lengths[:, None]).long()
    ro = Rollout(torch.zeros(n, 14, dtype=torch.long), torch.cat([torch.ones(n, 4, dtype=torch.long), cmask], 1), 4, cmask, loss_mask * cmask, adv, adv, None, None, {}, [], torch.zeros(n, dtype=torch.bool), 1.0, {})
    cfg = load_config(sets=[f"group_size={g}"], mode="grpo")
    halves = [slice(0, 16), slice(16, 32)]
    live = sorted(set(range(n)) - {5, 8, 9, 10, 11, 3})  # row 3's advantage is 0 too
    plan = plan_micro_batches(ro, cfg, halves)
    assert sorted(torch.cat(plan).tolist()) == live and max(len(p) for p in plan) <= 16
    widths = [[int(lengths[i]) for i in p] for p in plan]
    assert all(max(a) <= min(b) for a, b in zip(widths, widths[1:]))  # sorted: short rows share a micro-batch
    ranked = plan_micro_batches(ro, cfg, halves, ranks=2)  # DDP / FSDP: the same count of micro-batches on every rank
    assert len(ranked) == 2 and sorted(torch.cat(ranked).tolist()) == live
    silent = Rollout(ro.ids_NT, ro.attention_NT, 4, cmask, ro.loss_mask_NC, torch.zeros(n), adv, None, None, {}, [], ro.truncated_N, 1.0, {})
    assert [len(p) for p in plan_micro_batches(silent, cfg, halves)] == [1]  # nothing to learn: one row keeps the backward
    assert [len(p) for p in plan_micro_batches(silent, cfg, halves, ranks=2)] == [1, 1]
    for sets in (["loss=bnpo"],):  # normalised per micro-batch: the micro-batches as given
        assert [p.tolist() for p in plan_micro_batches(ro, load_config(sets=[f"group_size={g}", *sets], mode="grpo"), halves)] == [list(range(16)), list(range(16, 32))]


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("cost", [256, 0])  # 0: a micro-batch per length
@pytest.mark.parametrize("share", [True, False])  # each distinct prompt computed once (shared_prompt_logits), or every row's
def test_leaving_rows_without_signal_out_changes_no_gradient(rl_run, tmp_path, monkeypatch, loss, cost, share):
    from accelerate import Accelerator

    import paths.work.grpo as grpo
    from sharding.dataset import read_prompts

    model, tok = loaded(rl_run, tmp_path)
    cfg = load_config(sets=FAST + [f"loss={loss}", "group_size=4", "max_new_tokens=8", "mismatch=icepop"], steps=1)
    ro = rollout(model, None, read_prompts(rl_run, "rl", "p00")[:4], [load_reward(TOY)], cfg, tok)
    ro = short_rows(ro, [(5 * i) % 8 + 1 for i in range(16)])
    assert len(set(ro.attention_NT[:, : ro.prompt_len].sum(1).tolist())) > 1  # prompts of several lengths: the left trim is exercised too
    ro.advantages_N = torch.tensor([0.0] * 4 + [1.0, -1.0, 0.5, -0.5] + [0.0] * 4 + [2.0, -1.0, -0.5, -0.5])
    with torch.no_grad():  # as a worker sampled them: a little off the trainer's, some beyond icepop's band
        ro.behaviour_logp_NC = grpo.logprobs_in_chunks(model, ro.ids_NT, ro.attention_NT, ro.prompt_len, 1.0, 16) + torch.linspace(-0.3, 0.3, 16)[:, None]
    acc = Accelerator(cpu=True)
    monkeypatch.setattr(grpo, "MICRO_BATCH_COST", cost)
    grads, stats = [], []
    whole = lambda ro, rows: (ro.ids_NT[rows], ro.attention_NT[rows], ro.prompt_len, ro.completion_mask_NC.shape[1])  # noqa: E731  every column
    every_row = dataclasses.replace(cfg, share_prompts=False)  # each row its own pass
    planned = (grpo.plan_micro_batches, grpo.trimmed, cfg if share else every_row)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    for plan, trim, c in (planned, (lambda ro, cfg, rows, ranks=1: [torch.arange(r.start, r.stop) for r in rows], whole, every_row)):  # planned, then every row as given
        monkeypatch.setattr(grpo, "plan_micro_batches", plan)
        monkeypatch.setattr(grpo, "trimmed", trim)
        model.zero_grad()
        forwards.clear()
        stats.append(grpo_backward(model, acc, ro, c, [slice(0, 8), slice(8, 16)]))
        grads.append([p.grad.clone() for p in model.parameters()])
        shared = len(forwards) - stats[-1]["micro_batches"]  # a micro-batch that shares: a pass over its prompts, then its completions
        assert shared > 0 if c.share_prompts else shared == 0
    assert stats[0]["rows_computed"] == 0.5 and stats[1]["rows_computed"] == 1.0
    assert stats[0]["loss"] == pytest.approx(stats[1]["loss"], abs=1e-6) and stats[0]["clip_fraction"] == stats[1]["clip_fraction"]
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(*grads))
    assert any(float(a.abs().max()) > 1e-4 for a in grads[0])


def test_old_logprobs_of_a_reused_rollout_are_those_of_the_rows_it_trains(rl_run, tmp_path):
    from paths.work.grpo import logprobs_in_chunks, plan_micro_batches, planned_logprobs
    from sharding.dataset import read_prompts

    model, tok = loaded(rl_run, tmp_path)
    cfg = load_config(sets=FAST + ["group_size=4", "max_new_tokens=8", "iterations=2"], steps=1)
    ro = rollout(model, None, read_prompts(rl_run, "rl", "p00")[:4], [load_reward(TOY)], cfg, tok)
    whole = logprobs_in_chunks(model, ro.ids_NT, ro.attention_NT, ro.prompt_len, 1.0, 16) * ro.completion_mask_NC
    every = torch.cat(plan_micro_batches(ro, cfg, [slice(0, 16)]))
    assert torch.allclose(ro.old_logp_NC[every] * ro.completion_mask_NC[every], whole[every], atol=1e-5)  # as sampled: what to_rollout kept
    ro.advantages_N[4:8] = 0.0  # a group without signal
    ro.old_logp_NC = planned_logprobs(model, ro, cfg)
    live = torch.cat(plan_micro_batches(ro, cfg, [slice(0, 16)]))
    assert 0 < len(live) < 16
    assert torch.allclose(ro.old_logp_NC[live] * ro.completion_mask_NC[live], whole[live], atol=1e-5)
    dead = torch.tensor([i for i in range(16) if i not in live.tolist()])
    assert torch.equal(ro.old_logp_NC[dead], torch.zeros_like(ro.old_logp_NC[dead]))


# -- training ---------------------------------------------------------------------------------------------
def test_a_toy_reward_rises_within_30_cpu_steps(rl_run):
    cfg = load_config(sets=FAST + ["lr=1e-2"], steps=30)
    train(rl_run, "p00", "grpo", "rl", cfg, None, show_progress=False, rewards=[TOY])
    rewards = [m["reward_mean"] for m in metrics(rl_run, "p00")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.25 and last > 0.75, rewards
    m = metrics(rl_run, "p00")[-1]
    for key in ("reward_std", "zero_variance_groups", "completion_length", "kl", "clip_fraction", "completions_per_s", "tokens_per_s"):
        assert key in m


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo"])
def test_accumulating_4x1_equals_1x4(rl_run, tmp_path, loss):
    from accelerate import Accelerator

    from sharding.dataset import read_prompts

    model, tok = loaded(rl_run, tmp_path)
    cfg = load_config(sets=FAST + [f"loss={loss}", "group_size=4", "iterations=2"], steps=1)
    records = read_prompts(rl_run, "rl", "p00")[:4]
    ro = rollout(model, None, records, [load_reward(TOY)], cfg, tok)
    acc = Accelerator(cpu=True)
    grads = []
    for rows in ([slice(0, 16)], [slice(i, i + 4) for i in range(0, 16, 4)]):
        model.zero_grad()
        grpo_backward(model, acc, ro, cfg, rows)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-7, rtol=1e-5) for a, b in zip(*grads))


def test_resume_is_exact(tmp_path, tokenizer_dir, killed_after_first_checkpoint):
    def build(name):
        run = make_run(str(tmp_path / name), tokenizer_dir, 1)
        f = str(tmp_path / f"{name}.jsonl")
        write_jsonl(arithmetic(100, [1]), f)
        shard(run, ShardOptions(dataset="rl", inputs=[f], kind="prompts", text_field="prompt", holdout=0.0))
        return run

    cfg = load_config(sets=FAST + ["lr=1e-2", "checkpoint_every=3", "iterations=1"], steps=6)
    whole = build("a")
    train(whole, "p01", "grpo", "rl", cfg, None, show_progress=False, rewards=[TOY])
    broken = build("b")
    with killed_after_first_checkpoint():
        train(broken, "p01", "grpo", "rl", cfg, None, show_progress=False, rewards=[TOY])
    out = train(broken, "p01", "grpo", "rl", cfg, None, show_progress=False, rewards=[TOY])
    assert out["resumed_from"] == 3
    from safetensors.torch import load_file

    a = load_file(whole.store.path("work/p01/final/model.safetensors"))
    b = load_file(broken.store.path("work/p01/final/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["reward_mean"] for m in metrics(whole, "p01")] == [m["reward_mean"] for m in metrics(broken, "p01")]


# -- rewards and tasks ------------------------------------------------------------------------------------
def test_math_answer_and_format():
    assert extract_answer("so it is \\boxed{42}.") == 42 and extract_answer("Answer: -3.5") == -3.5
    assert extract_answer("first 3 then 7") == 7 and extract_answer("nothing") is None
    assert math_answer(["p"] * 3, ["Answer: 12", "it is 12.0", "Answer: 13"], ["12"] * 3) == [1.0, 1.0, 0.0]
    assert format_reward(["Give 'Answer: <number>'", "use \\boxed{}"], ["Answer: 1", "Answer: 1"], ["", ""]) == [1.0, 0.0]


def test_gen_tasks_answers_are_exact(tmp_path):
    out = tmp_path / "t.jsonl"
    result = CliRunner().invoke(main, ["gen-tasks", "arithmetic", "--n", "60", "--levels", "1,2,3,4", "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 60 and {r["level"] for r in rows} == {1, 2, 3, 4}
    for r in rows:
        m = re.match(r"Compute (.*)\. Give", r["prompt"])
        if m:
            assert eval(m.group(1)) == int(r["answer"]), r  # the expression really has that value
    assert out.read_text() == "".join(json.dumps(r) + "\n" for r in arithmetic(60, [1, 2, 3, 4]))


# -- bad input ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    ("nope.module:fn", "cannot be imported"),
    ("tests.paths.toy_rewards:missing", "cannot be imported"),
    ("tests.paths.toy_rewards:NOT_CALLABLE", "not callable"),
    ("unknown_builtin", "not a built-in reward"),
])
def test_reward_specs_that_cannot_load(spec, message):
    with pytest.raises(ConfigurationError, match=message):
        load_reward(spec)


@pytest.mark.parametrize("fn, message", [("wrong_length", "returned 1 values for 32 completions"), ("not_a_number", "NaN")])
def test_bad_reward_values_stop_with_nothing_committed(rl_run, fn, message):
    cfg = load_config(sets=FAST, steps=3)
    with pytest.raises(DataError, match=f"toy_rewards:{fn}.*{message}"):
        train(rl_run, "p00", "grpo", "rl", cfg, None, show_progress=False, rewards=[f"tests.paths.toy_rewards:{fn}"])
    assert not rl_run.store.exists("work/p00/final/manifest.json") and rl_run.checkpoints("p00") == []


def test_prompts_without_answers_and_small_groups(rl_run, tmp_path):
    f = tmp_path / "noanswer.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": ""}) + "\n" for i in range(20)))
    shard(rl_run, ShardOptions(dataset="bare", inputs=[str(f)], kind="prompts", text_field="prompt", holdout=0.0))
    manifest = json.loads(rl_run.store.read("data/bare/manifest.json"))
    path = max(manifest["paths"], key=lambda p: manifest["paths"][p]["train_docs"])
    with pytest.raises(DataError, match="needs answers"):
        train(rl_run, path, "grpo", "bare", load_config(sets=FAST, steps=1), None, show_progress=False, rewards=["math_answer"])
    with pytest.raises(ConfigurationError, match="--group-size must be >= 2"):
        load_config(group_size=1)


def test_lean_sampler_matches_the_model_and_keeps_the_cache_right(rl_run, tmp_path):
    """Greedy-equivalent check: at temperature -> 0 our KV-cached loop picks transformers'
    greedy tokens (left padding and positions included)."""
    from paths.work.sampling import generate, left_pad
    from sharding.dataset import read_prompts

    model, tok = loaded(rl_run, tmp_path)
    model.eval()
    records = read_prompts(rl_run, "rl", "p00")[:5]
    ids, mask = left_pad([r["ids"] for r in records], tok.pad_token_id)
    ours = generate(model, ids, mask, 8, 1e-6, 1.0, eos_id=-1, pad_id=tok.pad_token_id)
    theirs = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    assert torch.equal(ours, theirs)


def test_a_group_prefilled_once_samples_what_separate_prompts_sample(rl_run, tmp_path):
    """One prefill per prompt, its KV cache copied for the G completions (near-greedy, so the
    draws are fixed): the same tokens as prefilling every copy."""
    from paths.work.sampling import generate, left_pad
    from sharding.dataset import read_prompts

    model, _ = loaded(rl_run, tmp_path)
    model.eval()
    prompts = [r["ids"] for r in read_prompts(rl_run, "rl", "p00")[:3]]
    once = generate(model, *left_pad(prompts, 0), 6, 1e-6, 1.0, eos_id=-1, pad_id=0, repeats=4)
    each = generate(model, *left_pad([p for p in prompts for _ in range(4)], 0), 6, 1e-6, 1.0, eos_id=-1, pad_id=0)
    assert once.shape == (12, 6) and torch.equal(once, each)


def test_dropping_finished_rows_from_the_batch_changes_no_token(rl_run, tmp_path, monkeypatch):
    """Rows that produced EOS leave the batch (sampling.DROP_SHARE): every row draws the same
    tokens with the same log-probs as when the batch keeps every row to the end."""
    import paths.work.sampling as sampling
    from paths.work.sampling import generate, left_pad
    from sharding.dataset import read_prompts

    model, _ = loaded(rl_run, tmp_path)
    model.eval()
    ids, mask = left_pad([r["ids"] for r in read_prompts(rl_run, "rl", "p00")[:4]], 0)
    u = torch.rand(16, 12, generator=torch.Generator().manual_seed(0))
    free = generate(model, ids, mask, 12, 1.0, 1.0, eos_id=-1, pad_id=0, repeats=4, uniforms_NC=u)
    eos = int(free[:, 1:].flatten().mode().values)  # a token many rows draw, at several steps: rows end at different times
    runs = []
    for share in (2.0, 0.0, 0.25):  # never drop; drop at every step; the default
        monkeypatch.setattr(sampling, "DROP_SHARE", share)
        logp: list[torch.Tensor] = []
        runs.append((generate(model, ids, mask, 12, 1.0, 1.0, eos_id=eos, pad_id=0, repeats=4, uniforms_NC=u, logprobs=logp), torch.stack(logp, 1)))
    (kept, kept_lp), *dropped = runs
    ends = {int((row == eos).nonzero()[0]) for row in kept if (row == eos).any()}
    assert len(ends) >= 2 and not all((row == eos).any() for row in kept)  # rows finish at different steps, some never
    for out, lp in dropped:
        assert torch.equal(out, kept)
        live = torch.cat([torch.ones(len(kept), 1, dtype=torch.bool), (kept[:, :-1] != eos).cumprod(1).bool()], 1)[:, : lp.shape[1]]  # up to each row's EOS
        torch.testing.assert_close(lp[live], kept_lp[live], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_the_log_probs_sampling_computes_are_the_teacher_forced_ones(rl_run, tmp_path, dtype):
    """What a rollout worker in fp32 or int8 sends as behaviour log-probs, taken while sampling
    (groups prefilled once, rows ending at different lengths, left padding), is what one
    teacher-forced pass of the completions in the same dtype gives, within the seed check's fp32
    tolerance and far inside it (int8 quantizes each token by its own scale)."""
    from paths.work.grpo import logprobs_in_chunks, pack
    from paths.work.quantize import int8_copy
    from paths.work.sampling import complete
    from sharding.dataset import read_prompts

    model, tok = loaded(rl_run, tmp_path)
    model = int8_copy(model) if dtype == "int8" else model
    records = read_prompts(rl_run, "rl", "p00")[:4]
    torch.manual_seed(0)
    first, _ = complete(model, records, 4, tok, max_new_tokens=12, temperature=0.9, top_p=0.95, chunk=8)
    tok = SimpleNamespace(eos_token_id=first[0][5], pad_token_id=tok.pad_token_id)  # an EOS the untrained model draws: rows end early, at various lengths
    torch.manual_seed(0)
    drawn: list[list[float]] = []
    ids_out, _ = complete(model, records, 4, tok, max_new_tokens=12, temperature=0.9, top_p=0.95, chunk=8, logprobs=drawn)
    assert [len(d) for d in drawn] == [len(c) for c in ids_out] and len({len(c) for c in ids_out}) > 1
    ids, attention, p, _ = pack(records, ids_out, 4, tok.pad_token_id, torch.device("cpu"))
    forced = logprobs_in_chunks(model, ids, attention, p, 0.9, len(ids))
    for r, d in enumerate(drawn):
        torch.testing.assert_close(torch.tensor(d), forced[r, : len(d)], atol=1e-5, rtol=0)
