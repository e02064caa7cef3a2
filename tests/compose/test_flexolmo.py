"""FlexOlmo-style anchored training and opt-out: `--freeze shared` leaves every shared tensor
bitwise the base's; composing anchored paths places each trained expert into the base; the
domain-embed router sends a domain's tokens to its expert, and one owner's row does not depend on
the others; an excluded expert's weights have no effect on any output; bad input is refused."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from cli.main import main
from compose.merge import compose_moe
from paths.models import materialize
from paths.errors import ConfigurationError
from paths.families import fill, get_family
from paths.plan import Plan
from paths.work.train import train
from paths.train_config import load_config
from sharding.dataset import read_documents
from sharding.shard import ShardOptions, shard
from storage.layout import open_run
from storage.manifest import ArtifactWriter
from tests.sharding.conftest import docs, make_run, write_jsonl

DOMAINS = {"code": "p00", "math": "p01", "prose": "p02"}  # p03: the public expert nobody trains
FAMILY, PLAN = get_family("mixtral"), Plan(4, 4, 1)
EXPERT = "model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight"
DENSE = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@pytest.fixture(scope="module")
def anchored(tmp_path_factory, tokenizer_dir):
    """A one-level run (4 domain experts) with three paths trained anchored on their domains."""
    folder = tmp_path_factory.mktemp("flexolmo")
    run = make_run(str(folder / "run"), tokenizer_dir, 1)
    files = [write_jsonl(str(folder / "in" / f"part{k}.jsonl"), docs(150, 150 * k)) for k in range(2)]
    (folder / "map.json").write_text(json.dumps(DOMAINS))
    shard(run, ShardOptions(dataset="dom", inputs=files, router="domain", domain_field="domain", domain_map=str(folder / "map.json"), holdout=0.1))
    cfg = load_config(sets=["seq_len=32", "batch_size=4", "warmup_steps=1", "lr=3e-3", "freeze=shared"], steps=4, checkpoint_every=0)
    for pid in DOMAINS.values():
        train(run, pid, "lm", "dom", cfg, None, show_progress=False)
    return run


def copy_run(run, dest) -> object:
    shutil.copytree(run.store.root, dest)
    return open_run(str(dest))


def weights(run, key: str) -> dict[str, torch.Tensor]:
    return load_file(run.store.path(key))


def test_freeze_shared_leaves_every_shared_tensor_bitwise_the_base(anchored, tmp_path):
    materialize(anchored, "p01", str(tmp_path / "p01"))
    start = load_file(str(tmp_path / "p01" / "model.safetensors"))
    final = weights(anchored, "work/p01/final/model.safetensors")
    own = {FAMILY.dense_mlp(layer, part) for layer in range(4) for part in ("gate", "up", "down")}
    assert final.keys() == start.keys()
    assert all(torch.equal(final[k], start[k]) for k in start if k not in own)
    assert all(not torch.equal(final[k], start[k]) for k in own)  # the experts did train
    provenance = json.loads(anchored.store.read("work/p01/final/provenance.json"))
    assert provenance["anchored"] is True and provenance["config"]["freeze"] == "shared"


def test_composing_anchored_paths_places_each_expert_into_the_base(anchored):
    record = compose_moe(anchored, "placed")
    base, out = weights(anchored, "base/model.safetensors"), weights(anchored, "composed/placed/model.safetensors")
    assert out.keys() == base.keys()
    expected = dict(base)
    for e, pid in enumerate(sorted(DOMAINS.values())):
        final = weights(anchored, f"work/{pid}/final/model.safetensors")
        for layer in range(4):
            for w, dense in DENSE.items():
                expected[EXPERT.format(l=layer, e=e, w=w)] = final[f"model.layers.{layer}.mlp.{dense}.weight"]
    assert all(torch.equal(out[k], expected[k]) for k in base), [k for k in base if not torch.equal(out[k], expected[k])][:3]
    assert record["shared"].startswith("the base's") and all(p["anchored"] for p in record["paths"].values())


def _agreement(run, name: str, keep: list[int] | None = None) -> float:
    """Share of tokens whose top-1 expert is the one their domain's path trained."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run.store.path(f"composed/{name}")).eval()
    new = {old: i for i, old in enumerate(keep or range(4))}
    hits = total = 0
    for pid in DOMAINS.values():
        if PLAN.experts_per_layer(pid)[0] not in new:
            continue
        for ids in read_documents(run, "dom", pid, "heldout")[:10]:
            captured = {}
            hooks = [model.get_submodule(fill(FAMILY.router["memory"], l).rsplit(".", 1)[0]).register_forward_hook(
                lambda m, a, o, l=l: captured.__setitem__(l, o[0] if isinstance(o, tuple) else o)) for l in range(4)]
            with torch.no_grad():
                model(input_ids=torch.from_numpy(ids.astype("int64")).unsqueeze(0))
            for h in hooks:
                h.remove()
            for l in range(4):
                top = captured[l].argmax(-1)
                hits += int((top == new[PLAN.experts_per_layer(pid)[l]]).sum())
                total += top.numel()
    return hits / total


def test_domain_embed_routes_domains_to_their_experts_independently(anchored, tmp_path):
    compose_moe(anchored, "keep-routers")
    record = compose_moe(anchored, "embed", router="domain-embed", router_data="dom", router_docs=16)
    assert set(record["router_documents"]) == set(DOMAINS.values())
    kept, embedded = _agreement(anchored, "keep-routers"), _agreement(anchored, "embed")
    assert embedded > kept + 0.2 and embedded > 0.6, (kept, embedded)
    # each owner's row comes from its own expert and data: leaving math out changes no other owner's
    # row; the public expert's (p03, untrained) is the mean of the owners' kept directions
    compose_moe(anchored, "embed-no-math", router="domain-embed", router_data="dom", router_docs=16, exclude=["p01"])
    full, opted = weights(anchored, "composed/embed/model.safetensors"), weights(anchored, "composed/embed-no-math/model.safetensors")
    for layer in range(4):
        gate = f"model.layers.{layer}.block_sparse_moe.gate.weight"
        assert torch.equal(opted[gate][:2], full[gate][[0, 2]])
        centre = opted[gate][:2].double().mean(0)
        assert torch.allclose(opted[gate][2].double(), centre / centre.norm() * full[gate][[0, 2]].double().norm(dim=1).mean(), atol=1e-6)
    assert _agreement(anchored, "embed-no-math", keep=[0, 2, 3]) > 0.6


def test_an_excluded_expert_has_no_effect_on_any_output(anchored, tmp_path):
    from transformers import AutoModelForCausalLM

    run = copy_run(anchored, tmp_path / "anchored-copy")
    result = CliRunner().invoke(main, ["compose", run.url, "--name", "no-math", "--exclude", "p01"])
    assert result.exit_code == 0, result.output
    record = json.loads(run.store.read("composed/no-math/compose.json"))
    assert record["excluded"]["paths"] == ["p01"] and record["excluded"]["removed_experts"] == {str(l): [1] for l in range(4)}
    config = json.loads(run.store.read("composed/no-math/config.json"))
    assert config["num_local_experts"] == 3
    out = weights(run, "composed/no-math/model.safetensors")
    final_prose = weights(run, "work/p02/final/model.safetensors")
    assert torch.equal(out[EXPERT.format(l=0, e=1, w="w1")], final_prose["model.layers.0.mlp.gate_proj.weight"])  # expert 2 moved to 1
    assert EXPERT.format(l=0, e=3, w="w1") not in out

    # the math owner's expert replaced by random weights: the opted-out model does not change
    folder = tmp_path / "random-math"
    materialize(run, "p01", str(folder))
    noisy = {k: torch.randn_like(v) for k, v in load_file(str(folder / "model.safetensors")).items()}
    save_file(noisy, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "provenance.json").write_text(json.dumps({"path": "p01", "tokens": 1, "steps": 1, "anchored": False}))
    writer = ArtifactWriter(run.store, run.final("p01"))
    for name in sorted(os.listdir(folder)):
        writer.upload(name, str(folder / name))
    writer.commit(kind="final")
    compose_moe(run, "no-math-again", exclude=["p01"])
    compose_moe(run, "with-random-math")
    again = weights(run, "composed/no-math-again/model.safetensors")
    assert again.keys() == out.keys() and all(torch.equal(again[k], out[k]) for k in out)
    ids = torch.from_numpy(read_documents(run, "dom", "p01", "heldout")[0][:64].astype("int64")).unsqueeze(0)
    logits = {}
    for name in ("no-math", "no-math-again", "with-random-math"):
        model = AutoModelForCausalLM.from_pretrained(run.store.path(f"composed/{name}")).eval()
        with torch.no_grad():
            logits[name] = model(ids).logits
    assert torch.equal(logits["no-math"], logits["no-math-again"])
    assert not torch.allclose(logits["no-math"], logits["with-random-math"], atol=1e-3)  # the weights did matter when included


def test_opt_out_bad_input_is_refused_with_nothing_written(anchored, run2, tmp_path):
    run = copy_run(anchored, tmp_path / "anchored-copy")
    with pytest.raises(ConfigurationError, match="leaves 1 experts per layer, fewer than the 2"):
        compose_moe(run, "x", exclude=["p01", "p02", "p03"])
    with pytest.raises(ConfigurationError, match="does not go with --paths or --exclude"):
        compose_moe(run, "x", include=["p00"], exclude=["p01"])
    with pytest.raises(ConfigurationError, match="path id 'p09'"):
        compose_moe(run, "x", exclude=["p09"])
    with pytest.raises(ConfigurationError, match="without momentum"):
        compose_moe(run, "x", exclude=["p01"], momentum=0.5)
    with pytest.raises(ConfigurationError, match="needs --router-data"):
        compose_moe(run, "x", router="domain-embed")
    # two levels: leaving out p01-02 while p01-03 stays removes one expert in level 1 only
    from tests.compose.test_compose import finish

    for pid in ("p01-02", "p01-03"):
        finish(run2, pid, tmp_path)
    with pytest.raises(ConfigurationError, match=r"\[0, 0, 1, 1\] experts per layer"):
        compose_moe(run2, "x", exclude=["p01-02"])
    assert not run.store.exists("composed/x/manifest.json") and not run2.store.exists("composed/x/manifest.json")
    result = CliRunner().invoke(main, ["train", run.url, "--path", "p03", "--dataset", "dom", "--set", "freeze=all"])
    assert result.exit_code == 1 and "freeze must be none or shared" in result.output
