"""MoE blocks: the pure-torch reference block equals transformers' own MoE forward and backward
(every family; a block with a shared expert keeps its own forward); megablocks equals the reference on CUDA (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from experts.moe import load_balancing_loss, patched
from paths.base import build_model, load_spec, preset_path
from paths.families import get_family


FAMILIES = {"tiny-mixtral": "mixtral", "tiny-qwen3moe": "qwen3_moe", "tiny-qwen2moe": "qwen2_moe", "tiny-olmoe": "olmoe", "tiny-flexolmo": "flex_olmo",
            "tiny-deepseekv3": "deepseek_v3", "tiny-glm4moe": "glm4_moe", "tiny-gptoss": "gpt_oss"}


def tiny(preset: str, seed: int = 0):
    model = build_model(load_spec(preset_path(preset), preset), seed).float().eval()
    with torch.no_grad():  # routers that differ per token (Qwen3-MoE initialises them to zero)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_the_reference_block_equals_transformers_moe(preset):
    model = tiny(preset)
    family = get_family(FAMILIES[preset])
    x = torch.randint(3, model.config.vocab_size, (3, 17))
    theirs = model(x).logits
    theirs.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with patched(model, family, "reference") as found:
        ours = model(x).logits
        ours.sum().backward()
        assert len(found) == len(family.sparse_layers(model.config)) and all(len(b.logits) == 1 for b in found)
        assert load_balancing_loss(found) > 0
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[n], atol=1e-5, rtol=1e-4), n
    assert torch.equal(model(x).logits, theirs)  # transformers' forward is back


@pytest.mark.gpu
@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_megablocks_equals_the_reference_in_bf16(preset):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("megablocks")
    model = tiny(preset).to("cuda", torch.bfloat16)
    family = get_family(FAMILIES[preset])
    x = torch.randint(3, model.config.vocab_size, (2, 64), device="cuda")
    from experts.moe import blocks
    from paths.errors import ConfigurationError

    if blocks(model, family)[0].extras():  # a shared expert: megablocks computes routed experts only
        with pytest.raises(ConfigurationError, match="use --moe-backend reference"):
            with patched(model, family, "megablocks"):
                pass
        return
    with patched(model, family, "reference"):
        ref = model(x).logits.float()
        ref.sum().backward()
    ref_grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with patched(model, family, "megablocks"):
        ours = model(x).logits.float()
        ours.sum().backward()
    assert torch.allclose(ours, ref, atol=5e-2, rtol=5e-2)
    for n in ("model.embed_tokens.weight", "lm_head.weight"):  # gradients through the whole model
        assert torch.allclose(model.get_parameter(n).grad.float(), ref_grads[n], atol=5e-2, rtol=5e-2), n
