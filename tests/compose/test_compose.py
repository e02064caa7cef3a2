"""`paths compose --into moe`: untouched paths give the base back bitwise; a path's experts are
base + its delta, shared tensors the mean; Nesterov rounds by hand; S3 equals local; the result
loads and generates; bad input is refused with nothing written."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from cli.main import main
from compose.merge import compose_moe
from paths.models import materialize
from paths.errors import ConfigurationError, IntegrityError
from storage.manifest import ArtifactWriter
from tests.sharding.conftest import make_run

EXPERT = "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight"  # tiny-mixtral on disk
DENSE = "model.layers.{l}.mlp.gate_proj.weight"
SHARED = "model.layers.0.self_attn.q_proj.weight"


def finish(run, pid: str, tmp, change: dict[str, float] | None = None, tokens: int = 100) -> None:
    """A finished path as `paths train` leaves it, its weights = the path's + constants."""
    folder = str(tmp / f"final-{pid}")
    materialize(run, pid, folder)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    for name, value in (change or {}).items():
        weights[name] = weights[name] + value
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "provenance.json"), "w") as f:
        json.dump({"path": pid, "tokens": tokens, "steps": 1}, f)
    writer = ArtifactWriter(run.store, run.final(pid))
    for name in sorted(os.listdir(folder)):
        writer.upload(name, os.path.join(folder, name))
    writer.commit(kind="final")


def base_weights(run):
    return load_file(run.store.path("base/model.safetensors"))


def composed(run, name):
    return load_file(run.store.path(f"composed/{name}/model.safetensors"))


def test_untrained_paths_give_the_base_back_bitwise(run2, tmp_path):
    for pid in ("p00-01", "p02-03"):
        finish(run2, pid, tmp_path)
    compose_moe(run2, "same")
    base, out = base_weights(run2), composed(run2, "same")
    assert base.keys() == out.keys() and all(torch.equal(base[k], out[k]) for k in base)


def test_experts_get_their_paths_delta_and_shared_tensors_the_mean(run2, tmp_path):
    finish(run2, "p01-02", tmp_path, {DENSE.format(l=0): 0.5, DENSE.format(l=3): -0.25, SHARED: 0.25})
    finish(run2, "p03-02", tmp_path)
    record = compose_moe(run2, "c")
    base, out = base_weights(run2), composed(run2, "c")
    a, b = (load_file(run2.store.path(f"work/{p}/final/model.safetensors")) for p in ("p01-02", "p03-02"))

    def mean_of(*deltas):  # the formula, in the composer's order of operations (float32)
        total = torch.zeros_like(deltas[0])
        for d in deltas:
            total += d
        return total / len(deltas)

    # layer 0 is in level 0 (p01-02 chose expert 1, p03-02 expert 3); layer 3 in level 1 (both chose 2)
    b0, b3 = base[EXPERT.format(l=0, e=1)], base[EXPERT.format(l=3, e=2)]
    assert torch.equal(out[EXPERT.format(l=0, e=1)], a[DENSE.format(l=0)])  # one path fed it: its value, exactly
    assert torch.allclose(out[EXPERT.format(l=0, e=1)], b0 + 0.5, atol=1e-6)
    assert torch.equal(out[EXPERT.format(l=0, e=3)], base[EXPERT.format(l=0, e=3)])  # untrained path: delta 0
    assert torch.equal(out[EXPERT.format(l=0, e=0)], base[EXPERT.format(l=0, e=0)])  # nobody chose it
    assert torch.equal(out[EXPERT.format(l=3, e=2)], b3 + 1.0 * mean_of(a[DENSE.format(l=3)] - b3, b[DENSE.format(l=3)] - b3))
    assert torch.allclose(out[EXPERT.format(l=3, e=2)], b3 - 0.125, atol=1e-6)
    assert torch.equal(out[SHARED], base[SHARED] + 1.0 * mean_of(a[SHARED] - base[SHARED], b[SHARED] - base[SHARED]))
    assert record["tensors"][EXPERT.format(l=0, e=1)] == ["p01-02"] and record["tensors"][SHARED] == "all"
    assert EXPERT.format(l=0, e=0) not in record["tensors"]


def test_two_nesterov_rounds_by_hand(run2, tmp_path):
    finish(run2, "p00-00", tmp_path, {SHARED: 1.0})
    compose_moe(run2, "r1", momentum=0.5, outer_lr=1.0)
    compose_moe(run2, "r2", momentum=0.5, outer_lr=1.0, previous="r1")
    base = base_weights(run2)[SHARED]
    # round 1: d = 1, m = d = 1, update = d + 0.5 m = 1.5
    assert torch.allclose(composed(run2, "r1")[SHARED], base + 1.5, atol=1e-6)
    # round 2 (same deltas): m = 0.5 * 1 + 1 = 1.5, update = 1 + 0.5 * 1.5 = 1.75
    assert torch.allclose(composed(run2, "r2")[SHARED], base + 1.75, atol=1e-6)
    m = load_file(run2.store.path("composed/r2/momentum.safetensors"))[SHARED]
    assert torch.allclose(m, torch.full_like(m, 1.5))


@pytest.mark.s3
def test_composing_on_seaweedfs_equals_local(seaweed, bucket, tokenizer_dir, tmp_path):
    runs = [make_run(str(tmp_path / "local"), tokenizer_dir, 2), make_run(f"s3://{bucket}/compose-{tmp_path.name}", tokenizer_dir, 2, seaweed.storage_options)]
    for run in runs:
        finish(run, "p02-01", tmp_path / run.store.protocol, {SHARED: 0.5, DENSE.format(l=1): 0.125})
        finish(run, "p01-01", tmp_path / run.store.protocol)
        compose_moe(run, "c", weighting="tokens")
    local, s3 = (json.loads(r.store.read("composed/c/manifest.json"))["files"] for r in runs)
    assert local["model.safetensors"] == s3["model.safetensors"]




def test_the_composed_model_loads_and_generates(run2, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    finish(run2, "p00-03", tmp_path, {SHARED: 0.01})
    code = CliRunner().invoke(main, ["compose", run2.url, "--name", "hf", "--dtype", "bfloat16"])
    assert code.exit_code == 0, code.stderr
    folder = run2.store.path("composed/hf")
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "MixtralForCausalLM" and model.dtype == torch.bfloat16
    out = model.generate(tok("def f():", return_tensors="pt").input_ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > 3


def test_bad_input_is_refused_with_nothing_written(run2, tmp_path):
    (tmp_path / "a").mkdir()
    finish(run2, "p00-00", tmp_path / "a")
    with pytest.raises(ConfigurationError, match="p01-01 is not finished"):
        compose_moe(run2, "x", paths=["p00-00", "p01-01"])
    assert not run2.store.exists("composed/x/manifest.json")
    compose_moe(run2, "x")
    result = CliRunner().invoke(main, ["compose", run2.url, "--name", "x"])
    assert result.exit_code == 1 and "already exists" in result.stderr and "--overwrite" in result.stderr
    # a path from another base
    info = json.loads(run2.store.read("work/p00-00/final/path.json"))
    (tmp_path / "b").mkdir()
    finish(run2, "p02-02", tmp_path / "b")
    data = json.dumps({**info, "path": "p02-02", "base_checksum": "0" * 64}).encode()
    writer = ArtifactWriter(run2.store, run2.final("p02-02"))
    manifest = json.loads(run2.store.read("work/p02-02/final/manifest.json"))
    writer.files.update(manifest["files"])
    writer.write("path.json", data)
    writer.commit(kind="final")
    with pytest.raises(IntegrityError, match="path p02-02 was trained from another base"):
        compose_moe(run2, "y")
    # mismatching shapes
    (tmp_path / "c").mkdir()
    finish(run2, "p03-03", tmp_path / "c")
    w = load_file(run2.store.path("work/p03-03/final/model.safetensors"))
    w[SHARED] = w[SHARED][:, :8].contiguous()
    save_file(w, str(tmp_path / "bad.safetensors"), metadata={"format": "pt"})
    writer = ArtifactWriter(run2.store, run2.final("p03-03"))
    writer.files.update(json.loads(run2.store.read("work/p03-03/final/manifest.json"))["files"])
    writer.upload("model.safetensors", str(tmp_path / "bad.safetensors"))
    writer.commit(kind="final")
    with pytest.raises(IntegrityError, match="path p03-03: tensor .*q_proj.* has shape"):
        compose_moe(run2, "z", paths=["p03-03"])
    assert not run2.store.exists("composed/z/manifest.json")


def test_next_round_makes_the_composed_model_the_base(run2, tmp_path):
    from paths.work.claims import claim
    from paths.units import decomposed_paths
    from storage.admin import verify

    finish(run2, "p01-01", tmp_path, {SHARED: 0.5})
    claim(run2, ["p01-01"], ttl=60).finish("done")
    compose_moe(run2, "r1", momentum=0.5)
    before = run2.read_meta()["base"]["checksum"]
    result = CliRunner().invoke(main, ["next-round", run2.url, "--from", "composed:r1"])
    assert result.exit_code == 0, result.stderr
    meta = run2.read_meta()
    assert meta["round"] == 2 and meta["base"]["checksum"] != before and meta["rounds"][0]["composed"] == "r1"
    new_base, out = base_weights(run2), load_file(run2.store.path("composed/r1/model.safetensors"))
    assert all(torch.equal(new_base[k], out[k]) for k in out)
    assert run2.store.exists("rounds/r1/work/p01-01/final/manifest.json") and not run2.store.list("claims")
    assert len(decomposed_paths(run2)[1]) == 16
    assert json.loads(run2.store.read("paths/p01-01/path.json"))["base_checksum"] == meta["base"]["checksum"]
    materialize(run2, "p01-01", str(tmp_path / "r2-path"))  # round 2 paths are cut from the new base
    assert verify(run2).ok
    result = CliRunner().invoke(main, ["next-round", run2.url, "--from", "r1"])
    assert result.exit_code == 2


def test_centroid_routers_send_tokens_where_their_documents_trained(run2, corpus, tmp_path):
    from transformers import AutoModelForCausalLM

    from paths.families import fill, get_family
    from paths.plan import Plan
    from sharding.dataset import read_documents
    from sharding.shard import ShardOptions, shard

    mapping = {"code": "p00-01", "math": "p02-03", "prose": "p03-00"}
    (tmp_path / "map.json").write_text(json.dumps(mapping))
    shard(run2, ShardOptions(dataset="dom", inputs=corpus, router="domain", domain_field="domain", domain_map=str(tmp_path / "map.json"), holdout=0.0))
    for pid in mapping.values():
        finish(run2, pid, tmp_path)
    compose_moe(run2, "keep")
    record = compose_moe(run2, "centroid", router="centroid", router_data="dom")
    assert record["router_documents"] == {p: 64 for p in sorted(mapping.values())}
    family, plan = get_family("mixtral"), Plan(4, 4, 2)

    def agreement(name: str) -> float:
        model = AutoModelForCausalLM.from_pretrained(run2.store.path(f"composed/{name}")).eval()
        hits, total = 0, 0
        for pid in mapping.values():
            experts = plan.experts_per_layer(pid)
            for ids in read_documents(run2, "dom", pid)[:20]:
                captured = {}
                hooks = [model.get_submodule(fill(family.router["memory"], l).rsplit(".", 1)[0]).register_forward_hook(
                    lambda m, a, o, l=l: captured.__setitem__(l, o[0] if isinstance(o, tuple) else o)) for l in range(4)]
                with torch.no_grad():
                    model(input_ids=torch.from_numpy(ids[:128].astype("int64")).unsqueeze(0))
                for h in hooks:
                    h.remove()
                for l in range(4):
                    top = captured[l].argmax(-1)
                    hits += int((top == experts[l]).sum())
                    total += top.numel()
        return hits / total

    from storage.admin import verify

    assert verify(run2).ok  # the patched routers are what the manifest lists
    kept, centroid = agreement("keep"), agreement("centroid")
    assert centroid > kept + 0.2 and centroid > 0.5, (kept, centroid)
