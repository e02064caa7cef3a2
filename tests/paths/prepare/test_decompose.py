"""Decomposition invariants: a path is exactly the MoE with forced routing; parameter counts agree;
materializing reads only the path's bytes; upcycling preserves the dense model."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from experts.routing import forced_routing
from paths.prepare.init import upcycle
from paths.prepare.decompose import decompose
from paths.models import materialize
from paths.units import run_plan
from paths.families import get_family
from storage.layout import open_run



@pytest.fixture(autouse=True)
def _no_grad():
    """Forward passes only in this module (and no global switch left behind for other tests)."""
    with torch.no_grad():
        yield


def moe_of(run):
    """The base MoE loaded by stock transformers from the run's local base/ folder."""
    return AutoModelForCausalLM.from_pretrained(os.path.join(run.store.root, "base"), dtype=torch.float32).eval()


@pytest.mark.parametrize("levels, path_id", [(2, "p01-03"), (1, "p02"), (4, "p03-00-02-01")])
def test_path_logits_equal_moe_with_forced_routing(tiny_run, family_name, tmp_path, levels, path_id):
    decompose(tiny_run, levels, path_id)
    materialize(tiny_run, path_id, str(tmp_path / "path"))
    dense = AutoModelForCausalLM.from_pretrained(str(tmp_path / "path"), dtype=torch.float32).eval()
    moe = moe_of(tiny_run)
    experts = json.loads((tmp_path / "path" / "path.json").read_text())["experts"]
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with forced_routing(moe, get_family(family_name), experts):
        want = moe(x).logits
    got = dense(x).logits
    assert (got - want).abs().max().item() < 1e-5
    assert (moe(x).logits - want).abs().max().item() > 1e-4  # the override really changed routing
    # in bfloat16 (what the composed models are written in): within 2e-2 (the paths here are bitwise)
    moe16 = AutoModelForCausalLM.from_pretrained(os.path.join(tiny_run.store.root, "base"), dtype=torch.bfloat16).eval()
    with forced_routing(moe16, get_family(family_name), experts):
        want16 = moe16(x).logits.float()
    got16 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "path"), dtype=torch.bfloat16).eval()(x).logits.float()
    assert (got16 - want16).abs().max().item() < 2e-2


def test_parameter_count_matches_config(tiny_run, tmp_path):
    decompose(tiny_run, 2, "p00-01")
    out = str(tmp_path / "p")
    materialize(tiny_run, "p00-01", out)
    dense = AutoModelForCausalLM.from_pretrained(out)
    record = json.loads(open(os.path.join(out, "path.json")).read())
    assert record["parameters"] == sum(p.numel() for p in dense.parameters())
    from paths.base import load_spec, preset_path, spec_parameters
    from tests.conftest import PRESETS

    family = record["family"]
    assert spec_parameters(load_spec(preset_path(PRESETS[family]), "t"))["path"] == record["parameters"]


def test_decompose_writes_no_weights_and_verifies(tiny_run):
    decompose(tiny_run, 2)
    keys = [o.key for o in tiny_run.store.list("paths")]
    assert len([k for k in keys if k.endswith("path.json")]) == 16
    assert not any(k.endswith(".safetensors") for k in keys)
    from storage.admin import verify

    assert verify(tiny_run).ok


def test_materialize_flag_writes_loadable_init(tiny_run):
    decompose(tiny_run, 2, "p02-02", materialize=True)
    init = os.path.join(tiny_run.store.root, "paths", "p02-02", "init")
    assert AutoModelForCausalLM.from_pretrained(init) is not None


@pytest.mark.s3
def test_materialize_from_s3_reads_only_the_path(seaweed, bucket, tokenizer_dir, tmp_path):
    from paths.prepare.init import init_run

    url = f"s3://{bucket}/mat-{tmp_path.name}"
    init_run(url, preset="tiny-mixtral", tokenizer_dir=tokenizer_dir, storage_options=seaweed.storage_options)
    run = open_run(url, seaweed.storage_options)
    decompose(run, 2, "p03-01")
    run.store.bytes_read.clear()
    stats = materialize(run, "p03-01", str(tmp_path / "out"))
    weights_read = sum(n for k, n in run.store.bytes_read.items() if k.endswith(".safetensors"))
    path_bytes = json.loads((tmp_path / "out" / "path.json").read_text())["bytes"]
    assert weights_read <= path_bytes + stats["header_bytes_read"]
    base_bytes = sum(o.size for o in run.store.list("base") if o.key.endswith(".safetensors"))
    assert weights_read < 0.6 * base_bytes
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")) is not None


@pytest.mark.parametrize("dense_family", ["mixtral", "qwen3_moe", "flex_olmo"])
def test_upcycled_moe_equals_dense_model(dense_family, tmp_path, tokenizer_dir):
    from transformers import MistralConfig, MistralForCausalLM, Olmo2Config, Olmo2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    dense = {"mixtral": lambda: MistralForCausalLM(MistralConfig(**common)), "qwen3_moe": lambda: Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)),
             "flex_olmo": lambda: Olmo2ForCausalLM(Olmo2Config(**common))}[dense_family]()
    dense.save_pretrained(str(tmp_path / "dense"))
    url = str(tmp_path / "run")
    upcycle(url, str(tmp_path / "dense"), experts=4, top_k=2, tokenizer_dir=tokenizer_dir, seed=3)
    run = open_run(url)
    moe = moe_of(run)
    assert type(moe).__name__ == get_family(dense_family).moe_architecture
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    assert (moe(x).logits - dense.eval()(x).logits).abs().max().item() < 1e-5
    plan, _, _ = run_plan(run, 1)
    assert plan.num_experts == 4


def test_small_reads_give_identical_output_and_still_check(tiny_run, tmp_path, monkeypatch):
    """Tensors spread over many reads are hashed incrementally; output is byte-identical."""
    import paths.models as D
    from storage.safetensors_io import read_plan

    decompose(tiny_run, 2, "p01-01")
    materialize(tiny_run, "p01-01", str(tmp_path / "big"))
    monkeypatch.setattr(D, "read_plan", lambda entries: read_plan(entries, chunk=1000))
    materialize(tiny_run, "p01-01", str(tmp_path / "small"))
    assert (tmp_path / "big" / "model.safetensors").read_bytes() == (tmp_path / "small" / "model.safetensors").read_bytes()
    from paths.base import base_tensors
    from paths.errors import IntegrityError

    embed = base_tensors(tiny_run)[0]["model.embed_tokens.weight"]  # 131 KB: spans ~130 reads
    weights = os.path.join(tiny_run.store.root, "base", "model.safetensors")
    with open(weights, "r+b") as f:
        f.seek((embed.begin + embed.end) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(IntegrityError, match="tensor model.embed_tokens.weight does not match its sha256"):
        materialize(tiny_run, "p01-01", str(tmp_path / "bad"))
    assert not (tmp_path / "bad" / "model.safetensors").exists()
