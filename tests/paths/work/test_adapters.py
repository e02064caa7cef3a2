"""LoRA units: lm, sft and grpo train an adapter only; the checkpoint is the adapter and its
optimizer, and resume is exact; final/ is the merged path (peft's own merge gives the same); the
base may be int8; --freeze shared keeps every shared tensor the base's; bad settings are one line."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load, load_file

from paths.adapters import Int8Linear, LoraSpec, adapter_state, attach, merge, target_modules
from paths.checkpoint import check_resumable
from paths.errors import ConfigurationError
from paths.train_config import load_config
from paths.work.train import train
from storage.manifest import read_verified
from tests.paths.work.conftest import FAST, loaded, metrics, prompt_run
from tests.paths.work.test_train import final_weights, lm_run

LM = ["seq_len=16", "batch_size=4", "warmup_steps=1", "min_lr_ratio=1.0", "checkpoint_every=2"]  # a constant lr: a 4-step run resumed to 6 is a 6-step run


def lora_cfg(*sets: str, steps: int = 4, mode: str | None = None):
    return load_config(sets=[*LM, "lora_rank=4", "lr=1e-2", *sets], steps=steps, mode=mode)


def test_int8_lora_learns(tmp_path, tokenizer_dir):
    run = lm_run(str(tmp_path / "r"), tokenizer_dir)
    train(run, "p00-00", "lm", "lm", lora_cfg("quantize_base=int8", steps=8), None, show_progress=False)
    losses = [m["loss"] for m in metrics(run, "p00-00")]
    assert sum(losses[-3:]) < sum(losses[:3])


def base_of(run, path: str, tmp_path) -> dict[str, torch.Tensor]:
    model, _ = loaded(run, tmp_path, path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_lm_lora_trains_only_the_adapter_and_final_is_the_merged_path(tmp_path, tokenizer_dir):
    run = lm_run(str(tmp_path / "r"), tokenizer_dir)
    summary = train(run, "p02-01", "lm", "lm", lora_cfg(), None, show_progress=False)
    assert summary["lora"]["rank"] == 4 and summary["lora"]["trainable"] > 0
    ckpt = load(read_verified(run.store, run.checkpoint("p02-01", 2), "model.safetensors"))
    assert ckpt and all(".lora_" in k for k in ckpt)  # the checkpoint holds the adapter, not the base
    base, final = base_of(run, "p02-01", tmp_path), final_weights(run, "p02-01")
    adapter = load_file(run.store.path(f"{run.final('p02-01')}/adapter.safetensors"))
    adapted = {k.removesuffix(".lora_A.weight") + ".weight" for k in adapter if k.endswith("lora_A.weight")}
    assert any("self_attn" in k for k in adapted) and any("mlp" in k for k in adapted)
    for k, v in final.items():
        if k in adapted:
            assert not torch.equal(v, base[k]), k  # it learned
        else:
            assert torch.equal(v, base[k]), k  # nothing else moved
    assert all(torch.equal(final[k], v) for k, v in merge(base, adapter, 4 * 2 / 4).items() if k in final)


def test_our_merge_is_peft_merge(tmp_path, tokenizer_dir):
    run = lm_run(str(tmp_path / "r"), tokenizer_dir)
    model, _ = loaded(run, tmp_path, "p00-00")
    spec = LoraSpec(rank=2, alpha=6, targets=("attention",))
    wrapped = attach(model, spec, target_modules(model, spec, [], False, "p00-00")[:3] + ["model.layers.0.mlp.down_proj"])
    torch.manual_seed(3)
    for name, p in wrapped.named_parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.05)
    adapter = adapter_state(wrapped)
    base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v.clone() for k, v in wrapped.state_dict().items() if ".lora_" not in k}
    ours = merge(base, adapter, spec.scale)
    theirs = wrapped.merge_and_unload().state_dict()
    assert set(theirs) <= set(ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_resume_is_exact_and_refuses_another_adapter(tmp_path, tokenizer_dir):
    runs = [lm_run(str(tmp_path / f"r{i}"), tokenizer_dir) for i in range(2)]
    train(runs[0], "p01-02", "lm", "lm", lora_cfg(steps=6), None, show_progress=False)
    train(runs[1], "p01-02", "lm", "lm", lora_cfg(steps=5), None, show_progress=False)  # checkpoints at 2 and 4, then a final at 5
    runs[1].store.delete_prefix(runs[1].final("p01-02"))
    summary = train(runs[1], "p01-02", "lm", "lm", lora_cfg(steps=6), None, show_progress=False)
    assert summary["resumed_from"] == 4
    a, b = final_weights(runs[0], "p01-02"), final_weights(runs[1], "p01-02")
    assert all(torch.equal(a[k], b[k]) for k in a)
    for sets, steps in ((["lora_rank=0"], 8), (["lora_rank=8"], 8), (["lora_targets=attention"], 8)):
        with pytest.raises(ConfigurationError, match="checkpoint 4 of p01-02 was trained with lora"):
            train(runs[1], "p01-02", "lm", "lm", load_config(sets=[*LM, "lr=1e-2", "lora_rank=4", *sets], steps=steps), None, show_progress=False)
    state = json.loads(read_verified(runs[1].store, runs[1].checkpoint("p01-02", 4), "state.json"))
    job = {k: state[k] for k in ("mode", "dataset", "freeze", "lora", "start")}
    assert len(job["start"]) == 64  # the digest of the weights the adapter was trained over
    with pytest.raises(ConfigurationError, match="trained with start = .*other starting weights"):  # base/ or final/ changed under it
        check_resumable(runs[1], "p01-02", {**job, "start": "0" * 64})


def test_int8_base_trains_an_adapter_and_merges_into_fp32(tmp_path, tokenizer_dir):
    run = lm_run(str(tmp_path / "r"), tokenizer_dir)
    model, _ = loaded(run, tmp_path, "p00-00")
    spec = LoraSpec(rank=2, alpha=4, targets=("attention", "down_proj"), base="int8")
    wrapped = attach(model, spec, target_modules(model, spec, [], False, "p00-00"))
    assert any(isinstance(m, Int8Linear) for m in wrapped.modules())
    assert not any(p.requires_grad for n, p in wrapped.named_parameters() if ".lora_" not in n)
    summary = train(run, "p00-00", "lm", "lm", lora_cfg("quantize_base=int8"), None, show_progress=False)
    assert summary["lora"]["base"] == "int8"
    final = final_weights(run, "p00-00")
    assert all(v.dtype == torch.float32 for v in final.values())


def test_int8_linear_matches_the_dequantized_layer_and_its_gradient():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    q = Int8Linear(layer)
    w = q.qweight.float() * q.scale[:, None]
    assert (w - layer.weight).abs().max() <= q.scale.max() / 2 + 1e-7
    x = torch.randn(3, 5, 16, requires_grad=True)
    y = q(x)
    ref = torch.nn.functional.linear(x, w, layer.bias)
    assert torch.allclose(y, ref, atol=1e-5)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    (rx,) = torch.autograd.grad(ref, x, g)
    assert torch.allclose(gx, rx, atol=1e-5)


def test_freeze_shared_puts_adapters_beside_the_experts_only(tmp_path, tokenizer_dir):
    run = lm_run(str(tmp_path / "r"), tokenizer_dir)
    summary = train(run, "p03-00", "lm", "lm", lora_cfg("freeze=shared"), None, show_progress=False)
    base, final = base_of(run, "p03-00", tmp_path), final_weights(run, "p03-00")
    moved = [k for k in final if not torch.equal(final[k], base[k])]
    assert moved and all(".mlp." in k for k in moved)
    assert summary["anchored"]
    with pytest.raises(ConfigurationError, match="--freeze shared keeps .* the base's"):
        train(run, "p03-01", "lm", "lm", lora_cfg("freeze=shared", "lora_targets=attention"), None, show_progress=False)


@pytest.mark.parametrize("sets, match", [
    (["lora_targets=nope_proj"], "--lora target 'nope_proj' matches no linear layer of path p00-00"),
    (["lora_rank=4096"], "--lora rank 4096 is larger than"),
    (["lora_rank=0", "quantize_base=int8"], "--quantize-base int8 freezes the base under an adapter: add --lora RANK"),
    (["quantize_base=nf4"], "--quantize-base nf4 needs CUDA"),
    (["lora_dropout=1.5"], "lora_dropout must be in"),
])
def test_bad_lora_settings_are_one_line_and_write_nothing(tmp_path, tokenizer_dir, sets, match):
    if "nf4" in str(sets) and torch.cuda.is_available():
        pytest.skip("CUDA is here: nf4 is allowed")
    run = lm_run(str(tmp_path / "r"), tokenizer_dir)
    with pytest.raises(ConfigurationError, match=match) as info:
        train(run, "p00-00", "lm", "lm", lora_cfg(*sets), None, show_progress=False)
    assert "\n" not in str(info.value)
    assert not run.store.list("work/p00-00")


def test_grpo_and_sft_train_an_adapter(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    cfg = load_config(sets=[*FAST, "lora_rank=4", "lr=1e-2"], steps=2, mode="grpo")
    summary = train(run, "p01", "grpo", "rl", cfg, None, show_progress=False)
    assert summary["steps"] == 2 and summary["lora"]["rank"] == 4
    summary = train(run, "p02", "sft", "rl", load_config(sets=["seq_len=48", "batch_size=4", "lora_rank=4", "checkpoint_every=0"], steps=2), None, show_progress=False)
    assert summary["steps"] == 2 and os.path.exists(run.store.path(f"{run.final('p02')}/adapter.safetensors"))


def test_an_adapter_trained_path_composes_like_a_full_path_holding_peft_merged_weights(tmp_path, tokenizer_dir):
    import peft
    from transformers import AutoModelForCausalLM

    from compose.merge import compose_moe
    from paths.models import fetch_final
    from storage.manifest import ArtifactWriter

    docs_run = lm_run(str(tmp_path / "lm"), tokenizer_dir)  # 16 paths of documents
    train(docs_run, "p02-01", "lm", "lm", lora_cfg(steps=3), None, show_progress=False)
    compose_moe(docs_run, "lora")
    # the same path as a full fine-tune would leave it: peft's own merge of the same adapter, committed as final/
    folder = str(tmp_path / "final")
    fetch_final(docs_run, "p02-01", folder)
    adapter = load_file(os.path.join(folder, "adapter.safetensors"))
    model, _ = loaded(docs_run, tmp_path, "p02-01")
    targets = sorted({k.removesuffix(".lora_A.weight") for k in adapter if k.endswith(".lora_A.weight")})
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    peft.set_peft_model_state_dict(wrapped, {"base_model.model." + k: v for k, v in adapter.items()})
    merged = wrapped.merge_and_unload()
    out = str(tmp_path / "full")
    merged.save_pretrained(out)
    for name in ("config.json", "path.json", "provenance.json", "tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(folder, name)) and not os.path.exists(os.path.join(out, name)):
            os.link(os.path.join(folder, name), os.path.join(out, name))
    writer = ArtifactWriter(docs_run.store, docs_run.final("p02-01"))
    docs_run.store.delete_prefix(docs_run.final("p02-01"))
    for name in sorted(os.listdir(out)):
        writer.upload(name, os.path.join(out, name))
    writer.commit(kind="final")
    compose_moe(docs_run, "full")
    a = load_file(docs_run.store.path("composed/lora/model.safetensors"))
    b = load_file(docs_run.store.path("composed/full/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
