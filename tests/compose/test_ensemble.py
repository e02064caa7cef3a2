"""HDEE domain experts and ensembles: experts of different sizes are registered, claimed and
trained like paths; a one-member ensemble is that member; uniform mixing is the mean of the
members' probabilities; the posterior moves towards the member trained on a text's domain;
generate() is step-by-step argmax of the mixture; DiPaCo's router mix picks the member the saved
router picks; bad input is refused with one line."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from cli.main import main
from compose.ensemble import compose_ensemble
from experts.domain import add_expert
from paths.errors import ConfigurationError
from paths.work.train import train
from paths.train_config import load_config
from sharding.dataset import read_documents
from sharding.shard import ShardOptions, shard
from storage.layout import open_run
from tests.sharding.conftest import docs, make_run, write_jsonl

TRAIN = ["seq_len=48", "batch_size=4", "warmup_steps=1", "lr=3e-3"]


@pytest.fixture(scope="module")
def hdee(tmp_path_factory, tokenizer_dir):
    """A run with two experts of different sizes trained on disjoint toy domains (code, math),
    and two paths of a one-level plan trained on moe-routed data."""
    folder = tmp_path_factory.mktemp("hdee")
    run = make_run(str(folder / "run"), tokenizer_dir, 1)
    files = [write_jsonl(str(folder / "in" / "a.jsonl"), docs(360))]
    add_expert(run, "code-xs", "code", preset="tiny-xs", steps=3)
    add_expert(run, "math-s", "math", preset="tiny-s")
    shard(run, ShardOptions(dataset="dom", inputs=files, id_field="id", router="domain", targets="domains", domain_field="domain", holdout=0.1))
    cfg = load_config(sets=TRAIN, steps=25, checkpoint_every=0)
    for name in ("code-xs", "math-s"):
        train(run, name, "lm", "dom", cfg, None, show_progress=False)
    shard(run, ShardOptions(dataset="lm", inputs=files, id_field="id", router="moe", holdout=0.1))
    for pid in ("p00", "p01"):
        train(run, pid, "lm", "lm", load_config(sets=TRAIN, steps=3, checkpoint_every=0), None, show_progress=False)
    return run


def load(run, name):
    return AutoModelForCausalLM.from_pretrained(run.store.path(f"composed/{name}"), trust_remote_code=True).eval()


def member(run, name):
    return AutoModelForCausalLM.from_pretrained(run.store.path(f"work/{name}/final")).eval()


def heldout(run, domain, n=1, tokens=24) -> torch.Tensor:
    """(n, tokens): the first held-out documents of a domain at least `tokens` long."""
    long = [d for d in read_documents(run, "dom", domain, "heldout") if len(d) >= tokens][:n]
    assert len(long) == n
    return torch.stack([torch.from_numpy(d[:tokens].astype("int64")) for d in long])


def test_experts_are_registered_sharded_by_domain_and_trained_like_paths(hdee, tmp_path):
    manifest = json.loads(hdee.store.read("data/dom/manifest.json"))
    assert sorted(manifest["paths"]) == ["code", "math"]  # prose: no expert, left out and counted
    assert sum(i["skipped"]["no_expert"] for i in manifest["inputs"]) == 120
    result = CliRunner().invoke(main, ["expert", "ls", hdee.url, "--json"])
    listed = json.loads(result.output)
    assert listed["code-xs"]["config"]["hidden_size"] == 32 and listed["math-s"]["config"]["hidden_size"] == 48 and listed["code-xs"]["trained"]
    provenance = json.loads(hdee.store.read("work/math-s/final/provenance.json"))
    assert provenance["steps"] == 25 and json.loads(hdee.store.read("work/math-s/final/expert.json"))["domain"] == "math"
    # the worker loop: claim the expert by name; `paths train` runs its own budget (3 steps)
    run = open_run(str(shutil.copytree(hdee.store.root, tmp_path / "copy")))
    add_expert(run, "code-b", "code", branch_from="code-xs", steps=3)
    env = {"PATHS_HOME": str(tmp_path / "home")}
    result = CliRunner(env=env).invoke(main, ["claim", run.url, "--path", "code-b"])
    assert result.exit_code == 0, result.output
    result = CliRunner(env=env).invoke(main, ["train", "--dataset", "dom", "--no-progress", "--set", "seq_len=32", "--set", "batch_size=2"])
    assert result.exit_code == 0, result.output
    assert "trained code-b: 3 steps" in result.output
    status = json.loads(CliRunner().invoke(main, ["status", run.url, "--json"]).output)
    assert {r["path"]: r["state"] for r in status}["code-b"] == "done"


def test_a_one_member_ensemble_is_that_member(hdee):
    compose_ensemble(hdee, "solo", members=["math-s"])
    x = heldout(hdee, "math", 2)
    with torch.no_grad():
        ours = load(hdee, "solo")(x).logits
        theirs = torch.log_softmax(member(hdee, "math-s")(x).logits.float(), -1)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_uniform_is_the_mean_of_the_members_probabilities(hdee):
    compose_ensemble(hdee, "uni", members=["code-xs", "math-s"], mix="uniform")
    x = heldout(hdee, "code", 2)
    with torch.no_grad():
        ours = load(hdee, "uni")(x).logits.exp()
        mean = (member(hdee, "code-xs")(x).logits.softmax(-1) + member(hdee, "math-s")(x).logits.softmax(-1)) / 2
    assert torch.allclose(ours, mean, atol=1e-6)


def test_the_posterior_moves_towards_the_member_of_the_texts_domain(hdee):
    record = compose_ensemble(hdee, "post", members=["code-xs", "math-s"], prior="uniform")
    model = load(hdee, "post")
    for domain, j in (("code", 0), ("math", 1)):
        x = heldout(hdee, domain, 3)
        with torch.no_grad():
            w = model.mixture_weights(x)  # (B, T, J)
        assert torch.allclose(w.sum(-1), torch.ones(w.shape[:2]), atol=1e-5)
        assert torch.allclose(w[:, 0], torch.full((3, 2), 0.5))  # no context yet: the prior
        assert (w[:, -1, j] > 0.9).all(), (domain, w[:, -1])
    assert record["prior"] is None
    cached = compose_ensemble(hdee, "post-cached", members=["code-xs", "math-s"], prior_data="dom", prior_docs=20)
    assert abs(sum(cached["prior"]) - 1) < 1e-9 and json.loads(hdee.store.read("composed/post-cached/config.json"))["prior"] == cached["prior"]


def test_generate_is_step_by_step_argmax_of_the_mixture(hdee):
    compose_ensemble(hdee, "gen", members=["code-xs", "math-s"], prior_data="dom", prior_docs=10)
    model = load(hdee, "gen")
    x = heldout(hdee, "math", 2, tokens=12)
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=8, eos_token_id=[])  # the KV-cached loop
        seq = x
        for _ in range(8):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=-1)  # no cache
    assert torch.equal(out, seq)


def test_router_mix_picks_the_member_the_saved_router_picks(hdee):
    from sharding.inputs import Record
    from sharding.routers import Doc, load_router

    compose_ensemble(hdee, "dipaco", members=["p00", "p01"], mix="router", router_name="lm")
    model = load(hdee, "dipaco")
    router = load_router(hdee, "lm")
    picked = set()
    for pid in ("p00", "p01", "p02", "p03"):
        for ids in read_documents(hdee, "lm", pid, "heldout")[:2]:
            x = torch.from_numpy(ids[:40].astype("int64")).unsqueeze(0)
            scores = router.scores([Doc(Record("", "x"), [int(t) for t in ids[:40]] + [2])], hdee)[0]  # the prefix it saw in sharding
            want = ["p00", "p01"][int(scores[[router.paths.index("p00"), router.paths.index("p01")]].argmax())]
            with torch.no_grad():
                ours = model(x).logits
                theirs = torch.log_softmax(member(hdee, want)(x).logits.float(), -1)
            assert torch.allclose(ours, theirs, atol=1e-5)
            picked.add(want)
    assert picked == {"p00", "p01"}


def test_eval_scores_ensembles_and_experts(hdee):
    compose_ensemble(hdee, "for-eval", members=["code-xs", "math-s"], prior="uniform", overwrite=True)
    result = CliRunner().invoke(main, ["eval", hdee.url, "--dataset", "dom", "--model", "expert:code-xs", "--model", "expert:math-s", "--model", "composed:for-eval", "--json"])
    assert result.exit_code == 0, result.output
    table = json.loads(result.output)["table"]
    ens = table["composed:for-eval"]
    # the mixture is close to the better member on each domain, far better than the other
    assert ens["code"] < table["expert:math-s"]["code"] and ens["math"] < table["expert:code-xs"]["math"]


def test_bad_input_is_one_line(hdee, tmp_path, tokenizer_dir):
    from paths.tokenizer import train_bpe

    with pytest.raises(ConfigurationError, match="--members is empty"):
        compose_ensemble(hdee, "x", members=[])
    with pytest.raises(ConfigurationError, match="router 'dom' is domain"):
        compose_ensemble(hdee, "x", members=["p00", "p01"], mix="router", router_name="dom")
    with pytest.raises(ConfigurationError, match="--prior cached needs --prior-data"):
        compose_ensemble(hdee, "x", members=["p00", "p01"])
    # a member with another tokenizer
    other = tmp_path / "other"
    model = member(hdee, "code-xs")
    model.save_pretrained(other)
    train_bpe(300).save_pretrained(other)
    with pytest.raises(ConfigurationError, match=r"members other use another tokenizer"):
        compose_ensemble(hdee, "x", members=["code-xs", f"hf:{other}"], prior="uniform")
    with pytest.raises(ConfigurationError, match="tokenizer in .* differs from the run's"):
        add_expert(hdee, "foreign", "code", from_dir=str(other))
    with pytest.raises(ConfigurationError, match="exactly one of --from DIR, --preset SIZE or --branch-from"):
        add_expert(hdee, "two", "code", preset="tiny-xs", branch_from="code-xs")
    with pytest.raises(ConfigurationError, match="unknown expert preset 'huge'"):
        add_expert(hdee, "huge", "code", preset="huge")
    with pytest.raises(ConfigurationError, match="not a path id"):
        add_expert(hdee, "p07", "code", preset="tiny-xs")
    with pytest.raises(ConfigurationError, match="already exists"):
        add_expert(hdee, "code-xs", "code", preset="tiny-xs")
    assert not hdee.store.exists("composed/x/manifest.json") and not hdee.store.exists("experts/two/manifest.json")
    # an ensemble folder with a member missing
    compose_ensemble(hdee, "broken", members=["code-xs", "math-s"], prior="uniform")
    folder = shutil.copytree(hdee.store.path("composed/broken"), tmp_path / "broken")
    shutil.rmtree(os.path.join(folder, "members", "math-s"))
    with pytest.raises(OSError, match="member 'math-s' is missing"):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    result = CliRunner().invoke(main, ["compose", hdee.url, "--into", "ensemble", "--name", "y", "--members", ""])
    assert result.exit_code == 1 and "--members is empty" in result.output


def test_generate_with_left_padding_equals_each_prompt_alone(hdee):
    compose_ensemble(hdee, "pad", members=["code-xs", "math-s"], prior="uniform", overwrite=True)
    model = load(hdee, "pad")
    long, short = heldout(hdee, "math", 1, tokens=14)[0], heldout(hdee, "code", 1, tokens=9)[0]
    batch = torch.zeros(2, 14, dtype=torch.long)
    mask = torch.zeros(2, 14, dtype=torch.long)
    batch[0], mask[0] = long, 1
    batch[1, 5:], mask[1, 5:] = short, 1
    with torch.no_grad():
        together = model.generate(batch, attention_mask=mask, max_new_tokens=6, eos_token_id=[])
        alone = [model.generate(p[None], max_new_tokens=6, eos_token_id=[])[0, -6:] for p in (long, short)]
    assert torch.equal(together[0, -6:], alone[0]) and torch.equal(together[1, -6:], alone[1])


def test_generate_takes_what_evaluators_pass_and_the_config_says_the_context(hdee):
    """lm-eval, TRL and pipelines call generate() with max_length, stopping criteria, logits
    processors, pad_token_id, use_cache, a generation config: honoured, or harmless."""
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    compose_ensemble(hdee, "evalkw", members=["code-xs", "math-s"], prior_data="dom", prior_docs=10)
    model = load(hdee, "evalkw")
    contexts = [member(hdee, n).config.max_position_embeddings for n in ("code-xs", "math-s")]
    assert model.config.max_position_embeddings == min(contexts)
    x = heldout(hdee, "math", 2, tokens=12)
    plain = model.generate(x, max_new_tokens=6, eos_token_id=[])
    assert torch.equal(model.generate(x, max_length=x.shape[1] + 6, eos_token_id=[], use_cache=True, output_scores=False, synced_gpus=False), plain)
    assert torch.equal(model.generate(x, generation_config=GenerationConfig(max_new_tokens=6, do_sample=False), eos_token_id=[]), plain)

    class AfterThree(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= x.shape[1] + 3, dtype=torch.bool)

    stopped = model.generate(x, max_new_tokens=6, eos_token_id=[], stopping_criteria=StoppingCriteriaList([AfterThree()]), pad_token_id=0, attention_mask=torch.ones_like(x))
    assert torch.equal(stopped, plain[:, : x.shape[1] + 3])

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return torch.full_like(scores, -1e9).index_fill(-1, torch.tensor([7]), 0.0)

    forced = model.generate(x, max_new_tokens=4, eos_token_id=[], logits_processor=LogitsProcessorList([Force()]))
    assert (forced[:, x.shape[1]:] == 7).all()
    with pytest.raises(TypeError, match="beam search"):
        model.generate(x, max_new_tokens=2, num_beams=2)


LM_EVAL_TASKS = {
    "paths_mc": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n",
    "paths_ppl": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
    "paths_gen": "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
                 "metric_list:\n  - metric: exact_match\n",
}


def test_lm_evaluation_harness_runs_on_a_composed_moe_and_an_ensemble(hdee, tmp_path):
    """EleutherAI's lm-evaluation-harness (`lm_eval --model hf`, offline, local tasks written
    here): a multiple-choice, a loglikelihood_rolling and a generate_until task, on a composed
    MoE and on an ensemble (trust_remote_code)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("lm_eval")
    from compose.merge import compose_moe

    rows = {
        "paths_mc": [{"question": f"What is {i} + 1?", "choices": [str(i + 1), str(i + 2)], "label": 0} for i in range(6)],
        "paths_ppl": [{"text": f"def f{i}(x):\n    return x + {i}\n"} for i in range(4)],
        "paths_gen": [{"prompt": f"Compute {i} + 1. Answer:", "answer": f" {i + 1}"} for i in range(4)],
    }
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, body in LM_EVAL_TASKS.items():
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows[name]))
        (tasks / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n{body}")
    compose_moe(hdee, "lm-eval-moe", overwrite=True)
    compose_ensemble(hdee, "lm-eval-ens", members=["code-xs", "math-s"], prior_data="dom", prior_docs=10, overwrite=True)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for name in ("lm-eval-moe", "lm-eval-ens"):
        out = tmp_path / f"out-{name}"
        cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={hdee.store.path(f'composed/{name}')},trust_remote_code=True,dtype=float32",
               "--tasks", ",".join(LM_EVAL_TASKS), "--include_path", str(tasks), "--device", "cpu", "--batch_size", "2", "--output_path", str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = json.loads(next(p for p in out.rglob("results*.json")).read_text())["results"]
        assert 0 <= results["paths_mc"]["acc,none"] <= 1 and results["paths_ppl"]["bits_per_byte,none"] > 0
        assert "exact_match,none" in results["paths_gen"], results
