"""Environments as task sources and rewards: a reasoning-gym task, a single-turn verifiers
environment, a multi-turn one with a tool (episodes, environment tokens out of the loss), a
mixture, chat prompts, and every bad input the environments issue names."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from paths.envs.spec import check_versions, parse
from paths.errors import ConfigurationError, DataError
from paths.train_config import load_config
from paths.work.episodes import dataset_rewards
from paths.work.rewards import load_reward
from paths.work.tasks import write_jsonl
from paths.work.train import train
from sharding.dataset import read_prompts
from sharding.shard import ShardOptions, shard
from tests.paths.work.conftest import FAST as FAST_STORE  # the rollout tests' settings
from tests.paths.work.conftest import metrics
from tests.sharding.conftest import make_run

GYM = "reasoning-gym:basic_arithmetic:size=24,eval_size=6"
SINGLE = "verifiers:calc_single:n=24,eval_n=6"
TOOLS = "verifiers:calc_tools:n=8,eval_n=4"
FAST = ["batch_size=2", "group_size=4", "max_new_tokens=16", "warmup_steps=1", "checkpoint_every=0"]


def records(run, dataset: str, split: str = "train") -> list[dict]:
    from sharding.dataset import dataset_manifest

    return [r for p in sorted(dataset_manifest(run, dataset)["paths"]) for r in read_prompts(run, dataset, p, split)]


def trained_path(run, dataset: str) -> str:
    from sharding.dataset import dataset_manifest

    paths = sorted(dataset_manifest(run, dataset)["paths"].items(), key=lambda pc: (pc[1]["heldout_docs"] == 0, pc[0]))  # one with held-out prompts first
    return next(p for p, c in paths if c["train_docs"] >= 2)


@pytest.fixture
def run(tmp_path, tokenizer_dir):
    return make_run(str(tmp_path / "run"), tokenizer_dir, 1)


# -- specs ---------------------------------------------------------------------------------------
def test_specs_read_their_arguments_as_json_and_name_what_is_wrong():
    spec = parse("verifiers:calc_tools:n=3,hard=true,name=x,xs=[1,2]")
    assert (spec.kind, spec.name, spec.args) == ("verifiers", "calc_tools", {"n": 3, "hard": True, "name": "x", "xs": [1, 2]})
    assert parse(spec.text) == spec and spec.label == "verifiers:calc_tools"
    with pytest.raises(ConfigurationError, match="is not k=v"):
        parse("verifiers:calc_tools:oops")
    with pytest.raises(ConfigurationError, match="names no module"):
        parse("verifiers:")


# -- reasoning-gym -----------------------------------------------------------------------------------
def test_a_reasoning_gym_task_is_sharded_with_its_eval_split_and_scored_by_its_own_scorer(run):
    import reasoning_gym

    manifest = shard(run, ShardOptions(dataset="gym", inputs=[GYM], kind="prompts"))
    assert manifest["environments"] == [{"spec": parse(GYM).text, "package": "reasoning-gym", "version": reasoning_gym_version()}]
    assert sum(c["train_docs"] for c in manifest["paths"].values()) == 24 and sum(c["heldout_docs"] for c in manifest["paths"].values()) == 6
    recs = records(run, "gym")
    reward = load_reward(GYM)
    entries = [r["info"] for r in recs]
    gold = [f"thinking...\n<answer>{r['answer']}</answer>" for r in recs]
    wrong = [f"<answer>{r['answer']}1</answer>" for r in recs]
    fields = {"info": entries, "env": [r["env"] for r in recs]}
    assert reward([""] * len(recs), gold, [[]] * len(recs), fields) == [1.0] * len(recs)
    library = [reasoning_gym.get_score_answer_fn(e["metadata"]["source_dataset"])(w[8:-9], e) for w, e in zip(wrong, entries)]
    assert reward([""] * len(recs), wrong, [[]] * len(recs), fields) == library
    assert reward([""] * len(recs), [r["answer"] for r in recs], [[]] * len(recs), fields) == [0.0] * len(recs)  # no tags: no answer
    assert recs[0]["prompt"].startswith("<|user|>\n") and recs[0]["messages"][0]["role"] == "user"  # a chat prompt, rendered


def reasoning_gym_version() -> str:
    from importlib.metadata import version

    return version("reasoning-gym")


# -- single-turn verifiers ---------------------------------------------------------------------------
def test_a_single_turn_environment_renders_chat_prompts_and_its_rubric_scores_with_its_weights(run, tokenizer_dir):
    from transformers import AutoTokenizer

    shard(run, ShardOptions(dataset="single", inputs=[SINGLE], kind="prompts", system_prompt="Be brief."))
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    recs = records(run, "single")
    r = recs[0]
    assert r["messages"][0] == {"role": "system", "content": "Be brief."} and r["messages"][1]["role"] == "user"
    assert r["prompt"] == tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
    assert r["ids"] == tok(r["prompt"], add_special_tokens=False)["input_ids"]
    assert len(records(run, "single", "heldout")) == 6
    reward = dataset_rewards(run, "single", [])[0]
    fields = {k: [x.get(k) for x in recs[:3]] for k in ("messages", "answer", "info", "example_id", "env")}
    right, tagged, bare = (f"<answer>{x['answer']}</answer>" for x in recs[:1]), "<answer>-1</answer>", "no idea"
    got = reward([""] * 3, [next(right), tagged, bare], [[]] * 3, fields)
    assert got == pytest.approx([1.2, 0.2, 0.0])  # correct (weight 1) + tagged (weight 0.2)


def test_a_group_level_reward_function_sees_the_completions_of_one_prompt():
    """A rubric function over a group (verifiers' GroupRewardFunc) scores each prompt's completions
    together, never the whole batch: the shortest answer of each prompt gets its bonus."""
    from paths.envs.vf_env import RubricReward, rows

    spec = parse("verifiers:tests.paths.envs.group_env")
    recs = [r for r in rows(spec) if r["_split"] == "train"][:2]
    batch = [r for r in recs for _ in range(3)]
    completions = [recs[0]["answer"], "no", "a long wrong answer", "xyz", "wxyz", recs[1]["answer"] + " "]  # each prompt's shortest: its first and its last
    fields = {k: [r.get(k) for r in batch] for k in ("answer", "info", "example_id")}
    values = RubricReward(spec)(completions, messages=[r["prompt"] for r in batch], **fields)
    assert values == [1.5, 0.0, 0.0, 0.0, 0.0, 1.5]


def test_grpo_on_a_single_turn_environment_reports_its_rubric_and_heldout_reward(run):
    shard(run, ShardOptions(dataset="single", inputs=[SINGLE], kind="prompts"))
    path = trained_path(run, "single")
    train(run, path, "grpo", "single", load_config(sets=FAST + ["eval_every=2", "eval_prompts=4"], steps=2), None, show_progress=False)
    last = metrics(run, path)[-1]
    assert "reward/verifiers:calc_single" in last and "heldout_reward" in last


# -- multi-turn with a tool -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tool_model(tmp_path_factory, tokenizer_dir):
    """A run whose path has learnt, by SFT on one worked episode, to call the `add` tool and answer."""
    import calc_tools

    tmp = tmp_path_factory.mktemp("tools")
    run = make_run(str(tmp / "run"), tokenizer_dir, 1)
    demos = str(tmp / "demos.jsonl")
    write_jsonl(calc_tools.demonstrations(1, seed=0) * 16, demos)  # seed 0: the environment's first train row
    manifest = shard(run, ShardOptions(dataset="demos", inputs=[demos], kind="prompts", text_field="prompt", answer_field="completion", holdout=0))
    path = next(p for p, c in manifest["paths"].items() if c["train_docs"])
    cfg = load_config(sets=["batch_size=8", "lr=3e-3", "warmup_steps=2", "checkpoint_every=0", "seq_len=224"], steps=200)
    train(run, path, "sft", "demos", cfg, None, show_progress=False)
    shard(run, ShardOptions(dataset="tools", inputs=["verifiers:calc_tools:n=1,eval_n=1"], kind="prompts"))
    return run, path


def _final(run, path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paths.models import fetch_final

    fetch_final(run, path, str(tmp_path / "final"))
    return AutoModelForCausalLM.from_pretrained(str(tmp_path / "final")), AutoTokenizer.from_pretrained(str(tmp_path / "final"))


def test_an_episode_calls_the_tool_and_the_environments_tokens_stay_out_of_the_loss(tool_model, tmp_path):
    from paths.work.episodes import EpisodeSampler
    from paths.work.grpo import to_rollout

    run, path = tool_model
    model, tok = _final(run, path, tmp_path)
    sampler = EpisodeSampler(parse("verifiers:calc_tools:n=1,eval_n=1"), tok.chat_template)
    rec = records(run, "tools")[0]
    samples = sampler.samples(model, [rec], [], tok, group=2, budget=96, temperature=0.0, top_p=1.0, chunk=8)
    text = tok.decode(samples.completion_ids[0])
    a, b = (int(x) for x in rec["messages"][-1]["content"].split(" = ")[0].split(" + "))
    assert f'"arguments": {{"a": {a}, "b": {b}}}' in text and f"<|tool|>\n{a + b}</s>" in text, text
    assert samples.rewards == [1.1, 1.1]  # correct answer (1) + the tool ran (0.1)
    mask = samples.model_masks[0]
    env_tokens = tok(f"\n<|tool|>\n{a + b}</s>\n<|assistant|>\n", add_special_tokens=False)["input_ids"]
    start = mask.index(0)
    assert samples.completion_ids[0][start : start + len(env_tokens)] == env_tokens and sum(1 - m for m in mask) == len(env_tokens)
    assert all(lp == 0.0 for lp, m in zip(samples.logprobs[0], mask) if not m) and all(lp <= 0 for lp in samples.logprobs[0])
    assert sampler.last["episode/turns"] == 2.0 and not any(samples.truncated)
    cfg = load_config(sets=["batch_size=1", "group_size=2", "max_new_tokens=96"], mode="grpo")
    ro = to_rollout(samples, model, None, cfg, tok, 0.0)
    assert ro.loss_mask_NC[0].tolist()[: len(mask)] == mask and int(ro.loss_mask_NC[0].sum()) == sum(mask)
    assert int(ro.completion_mask_NC[0].sum()) == len(mask)  # the environment's tokens are still context


def test_an_episode_that_outgrows_its_budget_is_cut_and_counted(tool_model, tmp_path):
    from paths.work.episodes import EpisodeSampler

    run, path = tool_model
    model, tok = _final(run, path, tmp_path)
    sampler = EpisodeSampler(parse("verifiers:calc_tools:n=1,eval_n=1"), tok.chat_template)
    for budget in (10, 70):  # cut in the model's turn (a 58-token tool call); cut in the environment's answer (26 tokens)
        samples = sampler.samples(model, records(run, "tools"), [], tok, group=1, budget=budget, temperature=0.0, top_p=1.0, chunk=8)
        assert samples.truncated == [True] and len(samples.completion_ids[0]) == budget and samples.rewards[0] < 1.0  # never the answer's reward
        assert len(samples.model_masks[0]) == budget and (budget == 10) == all(samples.model_masks[0])


def test_grpo_runs_episodes_in_the_trainer(tool_model):
    run, path = tool_model
    cfg = load_config(sets=["batch_size=1", "group_size=4", "max_new_tokens=96", "warmup_steps=1", "checkpoint_every=0", "temperature=1.0"], steps=2)
    train(run, path, "grpo", "tools", cfg, None, show_progress=False, init="final")
    last = metrics(run, path)[-1]
    assert last["episode/turns"] >= 1 and "reward/verifiers:calc_tools/correct" in last
    with pytest.raises(ConfigurationError, match="rejection sampling takes single completions"):
        dataset_rewards(run, "tools", [])
    with pytest.raises(ConfigurationError, match="SAPO's shared experience"):
        train(run, path, "grpo", "tools", load_config(sets=["rollouts=store", "external=1"], steps=1), None, show_progress=False)


# -- mixtures ---------------------------------------------------------------------------------------
def test_a_mixture_scores_each_source_with_its_own_scorer_and_reports_each(run, tmp_path):
    shard(run, ShardOptions(dataset="mix", inputs=[GYM, SINGLE], kind="prompts"))
    recs = records(run, "mix")
    assert {r["env"] for r in recs} == {"reasoning-gym:basic_arithmetic", "verifiers:calc_single"}
    rewards = dataset_rewards(run, "mix", ["env"])
    from paths.work.rewards import score

    fields = {k: [r.get(k) for r in recs] for k in ("messages", "answer", "info", "example_id", "env")}
    completions = [f"<answer>{r['answer']}</answer>" for r in recs]
    total, means = score(rewards, [r["prompt"] for r in recs], completions, [[]] * len(recs), fields)
    assert total == [1.0 if r["env"].startswith("reasoning-gym") else 1.2 for r in recs]
    path = trained_path(run, "mix")
    train(run, path, "grpo", "mix", load_config(sets=FAST + ["batch_size=8", "group_size=2"], steps=1), None, show_progress=False)
    last = metrics(run, path)[-1]
    sources = {k.split("/")[1] for k in last if k.startswith("source/")}
    assert sources <= {"reasoning-gym:basic_arithmetic", "verifiers:calc_single"} and sources, last
    result = CliRunner().invoke(main, ["report", run.url, "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Mixtures: per source" in page and all(s in page for s in sources)


def test_a_mixture_ratio_holds_whatever_the_sizes_in_every_window():
    """3:1 over sources of 10 and 20 rows (a third of 20 at weight 0): every window of 8 prompts holds 6 and 2 (smooth weighted
    round robin), the small source cycles through all its rows before repeating one, and a rollout
    batch's seeded pick is apportioned exactly; the same seed draws the same prompts."""
    import random

    import numpy as np

    from paths.work.mixture import Mixture

    recs = [{"env": "a"}] * 10 + [{"env": "b"}] * 20 + [{}] * 20
    mix = Mixture(recs, "a=3,b=1,prompts=0", "the dataset")
    order = mix.order(400, np.random.default_rng(0))
    src = np.array([recs[i].get("env", "prompts") for i in order])
    for at in range(0, 392, 5):
        assert (src[at : at + 8] == "a").sum() == 6 and (src[at : at + 8] == "b").sum() == 2
    first_a = [int(i) for i in order[src == "a"][:10]]
    assert sorted(first_a) == list(range(10))
    assert "prompts" not in src
    picks = mix.pick(8, random.Random(1))
    assert sorted(recs[i].get("env") for i in picks) == ["a"] * 6 + ["b"] * 2 and picks == mix.pick(8, random.Random(1))
    assert sorted(recs[i].get("env") for i in mix.pick(6, random.Random(2))).count("a") in (4, 5)  # 4.5: the tie is broken by the seed


@pytest.mark.parametrize("text, message", [
    ("a=3", "gives no weight to b: the dataset holds a \\(1 rows\\), b \\(1 rows\\)"),
    ("a=1,b=1,c=2", "names c, which it does not hold"),
    ("a=x,b=1", "is not SOURCE=WEIGHT"),
    ("a=-1,b=1", "is not SOURCE=WEIGHT"),
    ("a=0,b=0", "gives every source weight 0"),
    ("a=1,a=2", "names 'a' twice"),
])
def test_a_mixture_that_does_not_fit_the_dataset_is_one_line(text, message):
    from paths.work.mixture import Mixture

    with pytest.raises(ConfigurationError, match=message):
        Mixture([{"env": "a"}, {"env": "b"}], text, "the dataset")


def test_a_mixture_sets_each_step_s_share_in_training_and_through_rollout_workers(run, tmp_path):
    """Sources of 24 and 48 prompts trained 3:1 the other way round: each local step's metrics show
    shares 0.75 / 0.25; a worker takes the ratio from the policy version and its batches, drawn
    in it, pass the trainer's prompt check, which uses the version's ratio, not its own."""
    from paths.work.rollouts import batch_key, decode, publish, rollout_worker
    from tests.paths.work.conftest import loaded
    from tests.paths.work.rollouts.conftest import SALT, STORE, keyed, rejections, settings

    shard(run, ShardOptions(dataset="mix", inputs=[GYM, "verifiers:calc_single:n=48,eval_n=6"], kind="prompts"))
    ratio = "reasoning-gym:basic_arithmetic=3,verifiers:calc_single=1"
    with pytest.raises(ConfigurationError, match="gives no weight to verifiers:calc_single"):
        train(run, "p00", "grpo", "mix", load_config(sets=FAST + ["mixture=reasoning-gym:basic_arithmetic=1"], steps=1), None, show_progress=False)
    train(run, "p00", "grpo", "mix", load_config(sets=FAST + ["batch_size=4", "group_size=2", f"mixture={ratio}"], steps=3), None, show_progress=False)
    assert [m["source/reasoning-gym:basic_arithmetic/share"] for m in metrics(run, "p00")] == [0.75] * 3
    for folder in ("policy", "rollouts", "work"):
        for o in run.store.list(f"{folder}/p00"):
            run.store.delete(o.key)
    model, _ = loaded(run, tmp_path)
    publish(run, "p00", 0, model, SALT, max_async=10, step=0, mixture=ratio)
    rollout_worker(run, "p00", "mix", settings(), dataset_rewards(run, "mix", []), key=keyed(run, tmp_path, "w"), batches=2, wait=5)
    recs = read_prompts(run, "mix", "p00", "train")
    batch = decode(run.store.read(batch_key(run, "p00", "w", 0)), "k", 1 << 30)
    assert sorted(recs[i]["env"] for i in batch.meta["prompt_index"]) == ["reasoning-gym:basic_arithmetic"] * 3 + ["verifiers:calc_single"]
    # the trainer now runs without the mixture (as if resumed with another): the batches' prompts are
    # checked against the mixture of the version they were sampled from, so honest ones still pass
    train(run, "p00", "grpo", "mix", load_config(sets=[*FAST_STORE, *STORE], steps=2), None, show_progress=False)
    assert not rejections(run) and [m["store_batches"] for m in metrics(run, "p00")] == [1, 1]


# -- bad input ---------------------------------------------------------------------------------------
def _shard_cli(run, *args):
    return CliRunner().invoke(main, ["shard", run.url, "--dataset", "bad", "--kind", "prompts", *args])


@pytest.mark.parametrize("spec, message", [
    ("verifiers:no_such_env", "no module 'no_such_env' is installed"),
    ("verifiers:tests.paths.envs.bad_envs", "load_environment raised RuntimeError: the task server is down (retry later)"),
    ("reasoning-gym:no_such_task", "reasoning-gym task 'no_such_task' cannot be made (ValueError: Dataset 'no_such_task' not registered)"),
])
def test_an_environment_that_cannot_load_is_one_line_and_writes_nothing(run, spec, message):
    result = _shard_cli(run, "--input", spec)
    assert result.exit_code != 0 and message in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not run.store.exists("data/bad/manifest.json") and not list(run.store.list("data/bad"))


@pytest.mark.parametrize("kind, message", [("nan", "reward is nan"), ("none", "rubric function .none_reward. failed on all 8 completions"),
                                           ("group", "rubric function .broken_group. failed on all 8 completions .the judge is down.")])
def test_a_rubric_returning_nan_or_none_stops_training(run, kind, message):
    spec = f"verifiers:tests.paths.envs.bad_envs:kind={kind}"
    shard(run, ShardOptions(dataset="bad", inputs=[spec], kind="prompts"))
    path = trained_path(run, "bad")
    with pytest.raises(DataError, match=message):
        train(run, path, "grpo", "bad", load_config(sets=FAST, steps=1), None, show_progress=False)
    assert not run.store.exists(f"work/{path}/final/manifest.json")


def test_unknown_roles_and_missing_chat_templates_are_one_line(run, tmp_path):
    f = str(tmp_path / "chat.jsonl")
    write_jsonl([{"prompt": [{"role": "robot", "content": "hi"}], "answer": "1"}], f)
    result = _shard_cli(run, "--input", f, "--text-field", "prompt")
    assert result.exit_code != 0 and "message 0 has unknown role 'robot'" in result.output
    write_jsonl([{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}], f)
    run.store.delete_prefix("data/bad")
    from paths.models import run_tokenizer

    tok, _ = run_tokenizer(run)
    tok.chat_template = None
    with pytest.MonkeyPatch.context() as mp:  # a run whose tokenizer has no template (a user's --tokenizer)
        mp.setattr("paths.models.run_tokenizer", lambda r: (tok, "no-template"))
        with pytest.raises(ConfigurationError, match="has no chat template: pass --chat-template FILE"):
            shard(run, ShardOptions(dataset="bad", inputs=[f], kind="prompts", text_field="prompt"))
        template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
        shard(run, ShardOptions(dataset="bad2", inputs=[f], kind="prompts", text_field="prompt", chat_template=template))
    assert records(run, "bad2")[0]["prompt"] == "[user] hi\n[assistant] "


def test_a_machine_with_another_environment_version_stops_with_the_version_to_install():
    check_versions([{"spec": SINGLE, "package": "verifiers", "version": version("verifiers")}], "dataset 'x'")
    with pytest.raises(ConfigurationError, match=r"dataset 'x' was made with verifiers 0\.1\.9 but this machine has .*: pip install 'verifiers==0\.1\.9'"):
        check_versions([{"spec": SINGLE, "package": "verifiers", "version": "0.1.9"}], "dataset 'x'")
    with pytest.raises(ConfigurationError, match="not installed here: pip install 'nopkg==1.0'"):
        check_versions([{"spec": "verifiers:x", "package": "nopkg", "version": "1.0"}], "dataset 'x'")


def version(name: str) -> str:
    from importlib.metadata import version as v

    return v(name)


# -- evaluation ---------------------------------------------------------------------------------------
def test_eval_gives_the_mean_reward_and_pass_at_k_per_task(tool_model, run):
    tools_run, path = tool_model
    result = CliRunner().invoke(main, ["eval", tools_run.url, "--dataset", "tools", "--split", "train", "--model", f"path:{path}", "--samples", "2",
                                       "--max-new-tokens", "96", "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.output)
    assert got["metric"] == "mean reward" and got["table"][f"path:{path}"][path] == pytest.approx(1.1)  # the greedy episode: tool, then the sum
    task = got["tasks"][f"path:{path}"]["verifiers:calc_tools"]
    assert task["reward"] == pytest.approx(1.1) and 0.0 <= task["pass@2"] <= 1.0 and task["prompts"] == 1
    shard(run, ShardOptions(dataset="mix", inputs=[GYM, SINGLE], kind="prompts"))
    result = CliRunner().invoke(main, ["eval", run.url, "--dataset", "mix", "--model", "base", "--samples", "2", "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert "per task" in result.output and "reasoning-gym:basic_arithmetic pass@2" in result.output and "verifiers:calc_single reward" in result.output


# -- rollout workers ---------------------------------------------------------------------------------
def test_a_single_turn_environment_feeds_the_trainer_through_rollout_workers(run, tmp_path):
    """Signed worker batches of environment prompts, scored by the rubric on both sides, pass the
    trainer's checks (rewards recomputed with the rubric, seeds checked) and are learned from."""
    from paths.work.rollouts import rollout_worker
    from tests.paths.work.rollouts.conftest import STORE, keyed, rejections, settings, start

    shard(run, ShardOptions(dataset="rl", inputs=["verifiers:calc_single:n=48,eval_n=4"], kind="prompts"))
    start(run, tmp_path)
    rollout_worker(run, "p00", "rl", settings(), dataset_rewards(run, "rl", []), key=keyed(run, tmp_path, "w"), batches=2, wait=5)
    train(run, "p00", "grpo", "rl", load_config(sets=[*FAST_STORE, *STORE], steps=2), None, show_progress=False)
    assert not rejections(run) and [m["store_batches"] for m in metrics(run, "p00")] == [1, 1]
    assert "reward/verifiers:calc_single" in metrics(run, "p00")[-1]


EPISODES = ["batch_size=1", "group_size=4", "max_new_tokens=96", "temperature=0.3", "warmup_steps=1", "checkpoint_every=0", "rollouts=store", "max_async=10",
            "rollout_wait=0", "verify_rows=4"]


@pytest.mark.parametrize("spec", ["verifiers:calc_tools:n=1,eval_n=1", "verifiers:tests.paths.envs.recorded_env:n=1,eval_n=1"], ids=["replayed", "recorded"])
def test_episodes_feed_the_trainer_through_rollout_workers_and_a_changed_environment_answer_is_caught(tool_model, tmp_path, spec):
    """Workers sample tool episodes from their seeds; the trainer replays each one (the environment
    answering anew, or from the answers the batch recorded when it is not deterministic), seed-checks
    the model's tokens and learns from them. An environment answer changed in a batch, its signature
    renewed, is rejected."""
    from paths.work.episodes import dataset_scoring
    from paths.work.rollouts import batch_key, decode, encode, publish, rollout_worker
    from tests.paths.work.rollouts.conftest import SALT, keyed, rejections

    run, path = tool_model
    dataset = "tools-" + spec.split(":")[1].split(".")[-1]
    shard(run, ShardOptions(dataset=dataset, inputs=[spec], kind="prompts"))
    model, _ = _final(run, path, tmp_path)
    for folder in ("policy", "rollouts"):  # a fresh asynchronous run of the path, from its trained weights
        for o in run.store.list(f"{folder}/{path}"):
            run.store.delete(o.key)
    publish(run, path, 0, model, SALT, max_async=10, step=0)
    cfg = load_config(sets=EPISODES, mode="grpo")
    rewards, episodes = dataset_scoring(run, dataset, [])
    key = keyed(run, tmp_path, f"w-{dataset}")
    rollout_worker(run, path, dataset, cfg, rewards, key=key, worker=f"w-{dataset}", batches=2, wait=5, episodes=episodes)
    honest = decode(run.store.read(batch_key(run, path, f"w-{dataset}", 0)), "k", 1 << 30)
    assert honest.model_masks is not None and any(0 in m for m in honest.model_masks) and honest.meta["environment"] == ("recorded" if "recorded" in spec else "replayed")
    if "recorded" in spec:
        assert any(said and said[0][0]["role"] == "tool" for said in honest.meta["environment_messages"])
    # the second batch: the number the tool answered raised by one in its tokens
    k = batch_key(run, path, f"w-{dataset}", 1)
    forged = decode(run.store.read(k), k, 1 << 30)
    tok = episodes_tokenizer(run, path, tmp_path)
    rows = [list(c) for c in forged.completion_ids]
    r = next(i for i, m in enumerate(forged.model_masks) if 0 in m)
    start = forged.model_masks[r].index(0)
    env_text = tok.decode(rows[r][start : start + forged.model_masks[r][start:].index(1)])
    number = int(env_text.split("<|tool|>")[1].split("</s>")[0])
    changed = tok(env_text.replace(str(number), str(number + 1)), add_special_tokens=False)["input_ids"]
    rows[r] = rows[r][:start] + changed + rows[r][start + forged.model_masks[r][start:].index(1) :]
    masks = [list(m) for m in forged.model_masks]
    masks[r] = masks[r][:start] + [0] * len(changed) + masks[r][start + forged.model_masks[r][start:].index(1) :]
    logp = torch.zeros(len(rows), max(map(len, rows)))
    for i, (row, m) in enumerate(zip(rows, masks)):
        old = [v for v, keep in zip(forged.behaviour_logp_NC[i].tolist(), forged.model_masks[i]) if keep]
        logp[i, [j for j, keep in enumerate(m) if keep]] = torch.tensor(old)
    run.store.write(k, encode(rows, logp, forged.meta, key, masks))
    train(run, path, "grpo", dataset, load_config(sets=EPISODES, steps=2), None, show_progress=False, init="final")
    got = rejections(run) if path == "p00" else {x["key"]: x for x in (json.loads(run.store.read(o.key)) for o in run.store.list(f"rollouts/{path}/rejected"))}
    assert list(got) == [k] and ("differs from the batch's" in got[k]["reason"] or "not in the batch" in got[k]["reason"]), got
    steps = metrics(run, path)[-2:]
    assert [m["store_batches"] for m in steps] == [1, 0] and steps[0]["episode/turns"] > 1 and steps[0]["episode/environment_tokens"] > 0


def test_a_multi_turn_environment_mixes_with_a_single_turn_source_in_the_trainer_and_through_workers(tool_model, tmp_path):
    """Tool episodes beside reasoning-gym prompts in one dataset, 1:1: a step runs episodes for
    the environment's rows and one model turn for the others (each scored by its own scorer,
    metrics per source); a worker's mixed batch passes the trainer's replay and seed checks."""
    from paths.work.episodes import dataset_scoring
    from paths.work.rollouts import publish, rollout_worker
    from tests.paths.work.rollouts.conftest import SALT, keyed, rejections

    run, path = tool_model
    shard(run, ShardOptions(dataset="tools-mix", inputs=["verifiers:calc_tools:n=1,eval_n=1", "reasoning-gym:basic_arithmetic:size=8,eval_size=2"], kind="prompts",
                            holdout=0))
    assert {r["env"] for r in read_prompts(run, "tools-mix", path, "train")} == {"verifiers:calc_tools", "reasoning-gym:basic_arithmetic"}
    ratio = "mixture=verifiers:calc_tools=1,reasoning-gym:basic_arithmetic=1"
    sets = ["batch_size=2", "group_size=2", "max_new_tokens=96", "temperature=0.3", "warmup_steps=1", "checkpoint_every=0", ratio]
    train(run, path, "grpo", "tools-mix", load_config(sets=sets, steps=1), None, show_progress=False, init="final")
    last = metrics(run, path)[-1]
    assert last["source/verifiers:calc_tools/share"] == 0.5 and "source/reasoning-gym:basic_arithmetic/reward" in last
    assert last["episode/turns"] > 1 and "reward/verifiers:calc_tools" in last and "reward/reasoning-gym:basic_arithmetic" in last
    plain = str(tmp_path / "plain.jsonl")
    write_jsonl([{"id": f"q{i}", "prompt": f"{i} + 1 = ?", "answer": str(i + 1)} for i in range(16)], plain)
    shard(run, ShardOptions(dataset="tools-plain", inputs=["verifiers:calc_tools:n=1,eval_n=1", plain], kind="prompts", text_field="prompt", id_field="id", holdout=0))
    with pytest.raises(ConfigurationError, match="mixes environments with plain prompts .*--reward env --reward math_answer"):
        dataset_scoring(run, "tools-plain", [])
    _, sampler = dataset_scoring(run, "tools-plain", ["env", "math_answer"])
    assert sampler.mine({"env": "verifiers:calc_tools"}) and not sampler.mine({"prompt": "1 + 1 = ?"})  # a plain row is one model turn, not an episode
    model, _ = _final(run, path, tmp_path)
    for folder in ("policy", "rollouts"):
        for o in run.store.list(f"{folder}/{path}"):
            run.store.delete(o.key)
    publish(run, path, 0, model, SALT, max_async=10, step=0, mixture=ratio.partition("=")[2])
    cfg = load_config(sets=[*EPISODES, "batch_size=2", ratio], mode="grpo")
    rewards, episodes = dataset_scoring(run, "tools-mix", [])
    rollout_worker(run, path, "tools-mix", cfg, rewards, key=keyed(run, tmp_path, "w-mix"), worker="w-mix", batches=2, wait=5, episodes=episodes)
    from paths.work.rollouts import batch_key, decode

    batch = decode(run.store.read(batch_key(run, path, "w-mix", 0)), "k", 1 << 30)
    recs = read_prompts(run, "tools-mix", path, "train")
    sources = [recs[i]["env"] for i in batch.meta["prompt_index"] for _ in range(cfg.group_size)]
    assert sorted(set(sources)) == ["reasoning-gym:basic_arithmetic", "verifiers:calc_tools"]
    assert all(all(m) for m, s in zip(batch.model_masks, sources) if s.startswith("reasoning-gym"))  # one model turn, no environment tokens
    train(run, path, "grpo", "tools-mix", load_config(sets=[*EPISODES, "batch_size=2", ratio], steps=2), None, show_progress=False, init="final")
    got = rejections(run) if path == "p00" else {o.key: o for o in run.store.list(f"rollouts/{path}/rejected")}
    assert not got and [m["store_batches"] for m in metrics(run, path)[-2:]] == [1, 1]


def episodes_tokenizer(run, path, tmp_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tmp_path / "final"))
