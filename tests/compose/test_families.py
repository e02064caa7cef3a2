"""Every family composes back: untouched paths give the base back bitwise; a path's trained expert
lands in its slot of the MoE (whatever form the path takes) and shared tensors (a shared expert
and its gate among them) are the mean; the composed model loads with stock transformers and
generates."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from transformers import AutoModelForCausalLM

from compose.finetune import finetune_moe
from compose.merge import compose_moe
from compose.rounds import next_round
from paths.models import materialize
from paths.errors import ConfigurationError
from paths.families import fill, get_family
from paths.prepare.decompose import decompose
from tests.compose.test_compose import base_weights, composed, finish


def expert(family, weights, layer: int, e: int, part: str = "down") -> torch.Tensor:
    """Expert e's projection in an MoE's tensors: its own tensor, or its slice of a fused one (GPT-OSS)."""
    return weights[family.disk_expert(layer, e, part)] if family.experts_disk else weights[fill(family.experts_memory[part], layer)][e]


def expert_name(family, layer: int, e: int, part: str = "down") -> str:
    return family.disk_expert(layer, e, part) if family.experts_disk else fill(family.experts_memory[part], layer)


def path_expert(family, weights, layer: int, part: str = "down") -> torch.Tensor:
    """A path's expert projection: a tensor of its own, or the one expert of a fused tensor."""
    return weights[family.dense_mlp(layer, part)] if family.experts_disk or family.has_dense_sibling else weights[family.dense_mlp(layer, part)][0]


def test_compose_of_decompose_is_the_model_bitwise(tiny_run, tmp_path):
    decompose(tiny_run, 1)
    for pid in ("p00", "p01", "p02", "p03"):
        finish(tiny_run, pid, tmp_path)
    compose_moe(tiny_run, "same")
    base, out = base_weights(tiny_run), composed(tiny_run, "same")
    assert base.keys() == out.keys() and all(torch.equal(base[k], out[k]) for k in base)


def test_a_paths_expert_and_the_shared_tensors_compose_into_their_places(tiny_run, family_name, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    family = get_family(family_name)
    decompose(tiny_run, 1)
    names = [k for k in base_weights(tiny_run) if family.classify(k).kind == "shared" and ".layers.1." in k and k.endswith("weight") and "norm" not in k]
    shared = next((k for k in names if "shared_expert" in k), names[0])  # a shared expert where the family has one
    finish(tiny_run, "p02", tmp_path, {family.dense_mlp(1, "down"): 0.5, shared: 0.25})
    finish(tiny_run, "p03", tmp_path, {shared: -0.75})
    path_json = json.loads((tmp_path / "final-p02" / "path.json").read_text())
    assert path_json["form"] == family.path_form
    compose_moe(tiny_run, "c")
    base, out = base_weights(tiny_run), composed(tiny_run, "c")
    down = expert_name(family, 1, 2)
    assert torch.equal(expert(family, out, 1, 2), expert(family, base, 1, 2) + 0.5) and torch.equal(expert(family, out, 1, 3), expert(family, base, 1, 3))
    assert torch.allclose(out[shared], base[shared] - 0.25)
    changed = {k for k in base if not torch.equal(base[k], out[k])}
    assert changed == {down, shared}, changed
    folder = tiny_run.store.path("composed/c")
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == family.moe_architecture
    tok = AutoTokenizer.from_pretrained(folder)
    assert model.generate(tok("def f():", return_tensors="pt").input_ids, max_new_tokens=4, do_sample=False).shape[1] > 3


@pytest.mark.slow
def test_every_stage_runs_on_the_family(tiny_run, family_name, tmp_path):
    """Shard, claim, train (lm and grpo, 2 steps each), a rollout worker's batch taken by an
    asynchronous trainer, compose into an MoE and into an ensemble, `paths eval`, and
    lm-evaluation-harness's `hf` model loading the composed MoE: on every family."""
    from paths.train_config import load_config
    from paths.work.claims import claim
    from paths.work.rewards import load_reward
    from paths.work.rollouts import publish, rollout_worker
    from paths.work.tasks import arithmetic, write_jsonl
    from paths.work.train import train
    from compose.ensemble import compose_ensemble
    from compose.evaluate import evaluate
    from sharding.shard import ShardOptions, shard
    from tests.paths.work.conftest import FAST, loaded, metrics
    from tests.paths.work.rollouts.conftest import SALT, STORE, keyed, rejections, settings
    from tests.sharding.conftest import docs
    from tests.sharding.conftest import write_jsonl as write_docs

    run = tiny_run
    decompose(run, 1)
    shard(run, ShardOptions(dataset="lm", inputs=[write_docs(str(tmp_path / "docs.jsonl"), docs(160))], id_field="id", router="hash", holdout=0.1))
    write_jsonl(arithmetic(160, [1]), str(tmp_path / "tasks.jsonl"))
    shard(run, ShardOptions(dataset="rl", inputs=[str(tmp_path / "tasks.jsonl")], kind="prompts", text_field="prompt", holdout=0.1))
    train(run, "p00", "lm", "lm", load_config(sets=["seq_len=32", "batch_size=2", "warmup_steps=1", "checkpoint_every=0"], steps=2), claim(run, ["p00"]),
          show_progress=False)
    train(run, "p01", "grpo", "rl", load_config(sets=FAST, steps=2), claim(run, ["p01"]), show_progress=False)
    model, _ = loaded(run, tmp_path, "p02")
    publish(run, "p02", 0, model, SALT, max_async=10, step=0)
    cfg = settings()
    rollout_worker(run, "p02", "rl", cfg, [load_reward("math_answer")], key=keyed(run, tmp_path, "w"), batches=1, wait=5)
    train(run, "p02", "grpo", "rl", load_config(sets=[*FAST, *STORE], steps=1), claim(run, ["p02"]), show_progress=False)
    assert [m["store_batches"] for m in metrics(run, "p02")] == [1] and not {o.key for o in run.store.list("rollouts/p02/rejected")}
    train(run, "p03", "lm", "lm", load_config(sets=["seq_len=32", "batch_size=2", "warmup_steps=1", "checkpoint_every=0", "freeze=shared"], steps=1),
          claim(run, ["p03"]), show_progress=False)  # FlexOlmo's anchored training: only the path's expert moves
    anchored = load_file(run.store.path("work/p03/final/model.safetensors"))
    base = base_weights(run)
    family = get_family(family_name)
    assert all(torch.equal(v, base[k]) for k, v in anchored.items() if k in base and family.classify(k).kind == "shared")
    first = family.sparse_layers(json.loads(run.store.read("base/config.json")))[0]  # a dense first layer has no expert
    assert not torch.equal(path_expert(family, anchored, first), expert(family, base, first, 3))
    compose_moe(run, "moe")
    for router in ("centroid", "domain-embed"):
        record = compose_moe(run, router, router=router, router_data="lm", router_docs=8)
        gate = family.router["disk"].replace("${layer}", "1")
        assert record["options"]["router"] == router and record["router_documents"] and not torch.equal(composed(run, router)[gate], base[gate])
    if family.router_groups(json.loads(run.store.read("base/config.json"))) > 1:  # 4 experts in 2 groups: no exclusion leaves groups of 2
        with pytest.raises(ConfigurationError, match="cannot split into groups of 2 or more"):
            compose_moe(run, "opt-out", exclude=["p01"])
        assert not run.store.exists("composed/opt-out/manifest.json")
    else:
        compose_moe(run, "opt-out", exclude=["p01"])
        assert composed(run, "opt-out")[family.router["disk"].replace("${layer}", "0")].shape[0] == 3  # p01's expert gone from every layer
        opted = AutoModelForCausalLM.from_pretrained(run.store.path("composed/opt-out"))
        assert type(opted).__name__ == family.moe_architecture and opted(torch.tensor([[5, 6, 7]])).logits.isfinite().all()
    finetune_moe(run, "moe", "lm", "moe-ft", load_config(sets=["seq_len=32", "batch_size=2", "warmup_steps=1", "checkpoint_every=0"], steps=2),
                 backend="reference", show_progress=False)
    compose_ensemble(run, "ens", members=["p00", "p01"], prior="uniform")
    scores = evaluate(run, "lm", ["composed:moe", "composed:ens", "path:p00"], max_tokens=2000)
    assert all(0 < scores["table"][m]["overall"] < 1e4 for m in ("composed:moe", "composed:ens", "path:p00")), scores
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=run.store.path("composed/moe"), device="cpu", batch_size=1, dtype="float32")
    (logprob, _), = lm.loglikelihood([Instance("loglikelihood", {}, ("def f(x):", " return x"), 0)])
    assert logprob < 0
    next_round(run, "moe")  # DiLoCo: the composed model is the next round's base, cut into paths again
    assert decompose(run, 1)["paths"] == ["p00", "p01", "p02", "p03"]
    materialize(run, "p02", str(tmp_path / "round2-p02"))
    assert torch.equal(path_expert(family, load_file(str(tmp_path / "round2-p02" / "model.safetensors")), 1), expert(family, composed(run, "moe"), 1, 2))
