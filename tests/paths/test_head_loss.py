"""The chunked head loss (paths/head_loss.py) is the whole-logits loss: same value, same gradients,
for every family's tiny preset; wrapped models take the whole-logits route."""

import pytest
import torch

from paths import head_loss as hl
from paths.base import build_model, load_spec, preset_path
from paths.steps import micro_loss

TINY = ["tiny-mixtral", "tiny-qwen2moe", "tiny-qwen3moe", "tiny-olmoe", "tiny-deepseekv3", "tiny-glm4moe", "tiny-gptoss", "tiny-flexolmo"]


def batch(vocab: int, b: int = 3, length: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "tokens": torch.randint(3, vocab, (b, length + 1), generator=g),
        "valid": torch.tensor([length + 1, 7, 1])[:b],  # a full row, a short one, one with no target
        "loss_from": torch.tensor([0, 3, 0])[:b],  # sft: the second row's prompt does not count
    }


def grads(model: torch.nn.Module, b: dict[str, torch.Tensor], total: int) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = micro_loss(model, b, total)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset", TINY)
def test_the_chunked_head_loss_is_the_whole_logits_loss(preset, monkeypatch):
    model = build_model(load_spec(preset_path(preset), preset), seed=0).float()
    assert hl.fusable(model), f"{model.config.model_type}: add it to PLAIN_HEADS if its logits are lm_head(hidden)"
    b = batch(model.config.vocab_size)
    monkeypatch.setattr(hl, "CHUNK", 5)  # chunks that cut rows of the batch, and a short last one
    loss, fused = grads(model, b, total=17)
    monkeypatch.setattr("paths.steps.fusable", lambda m: False)
    ref_loss, ref = grads(model, b, total=17)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert fused.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(fused[name], ref[name], rtol=1e-5, atol=1e-6)


def test_a_frozen_head_gets_no_gradient_and_no_grad_mode_makes_none(monkeypatch):
    model = build_model(load_spec(preset_path("tiny-mixtral"), "tiny-mixtral"), seed=0)
    model.lm_head.weight.requires_grad_(False)
    b = batch(model.config.vocab_size)
    loss, g = grads(model, b, total=17)
    assert "lm_head.weight" not in g and "model.embed_tokens.weight" in g
    model.lm_head.weight.requires_grad_(True)
    made = []  # the head's gradient buffer, made only when a gradient will be asked for
    real = torch.zeros_like
    monkeypatch.setattr(torch, "zeros_like", lambda t, *a, **k: (made.append(1) if t is model.lm_head.weight else None) or real(t, *a, **k))
    with torch.no_grad():
        assert float(micro_loss(model, b, 17)) == pytest.approx(loss, rel=1e-6)
    assert not made
    micro_loss(model, b, 17)
    assert made


def test_wrapped_or_softcapped_models_take_the_whole_logits_route():
    model = build_model(load_spec(preset_path("tiny-mixtral"), "tiny-mixtral"), seed=0)
    assert not hl.fusable(torch.nn.Sequential(model))  # a wrapper's forward (DDP, PEFT) must run
    model._original_forward = model.forward  # accelerate's autocast wrapper
    assert not hl.fusable(model)
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    assert not hl.fusable(gemma)  # final logit softcapping
