"""The int8 actor: every matrix multiply of the feed-forward experts and attention in int8, the
routers in fp32, the learner's model untouched, and logits close to the fp32 model's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paths.errors import ConfigurationError

from paths.families import get_family
from paths.models import load_base_model
from paths.work.quantize import Int8Experts, int8_copy, is_fused_experts
from paths.work.rollouts import sampler


# Greedy agreement at random init. FlexOlmo is post-norm: each sublayer's output (tiny at random
# init) is normalised to the residual's scale, int8's rounding with it, so near-flat logits flip
# more often (85% where the top-2 margin exceeds 0.01, against 98-100% for the pre-norm families);
# the KL bound is the same for every family. The tiny DeepSeek-V3's logits are flatter still: 17% of
# positions have a top-2 margin under 0.01, where int8 flips them; elsewhere 98.8% agree.
AGREE = {"flex_olmo": 0.8, "deepseek_v3": 0.85}


def refuses_int8(tiny_run, family_name) -> bool:
    """GPT-OSS's experts are transposed, with biases: int8 sampling refuses them in one line."""
    if family_name != "gpt_oss":
        return False
    with pytest.raises(ConfigurationError, match="sample in fp32 or bf16"):
        int8_copy(load_base_model(tiny_run))
    return True


def test_int8_copy_quantizes_experts_and_linears_keeps_routers(tiny_run, family_name):
    if refuses_int8(tiny_run, family_name):
        return
    model = load_base_model(tiny_run).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = int8_copy(model)

    assert not any(is_fused_experts(m) for m in q.modules()), "fused fp32 experts left in the int8 copy"
    assert sum(isinstance(m, Int8Experts) for m in q.modules()) == len(get_family(family_name).sparse_layers(model.config))  # one per layer with experts
    assert not any(isinstance(m, nn.Linear) for m in q.modules()), "an fp32 nn.Linear left in the int8 copy"
    routers = [m for name, m in q.named_modules() if name.endswith("mlp.gate")]
    assert routers and all(r.weight.dtype == torch.float32 for r in routers)
    for k, v in model.state_dict().items():  # the learner's weights are not touched
        assert torch.equal(v, before[k]), k

    ids = torch.randint(3, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = model(ids).logits, q(ids).logits
    assert got.shape == ref.shape
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    assert not torch.equal(got, ref)  # int8 rounds
    assert kl < 0.01, f"int8 next-token distributions {kl:.4f} nats from fp32's"
    assert agree > AGREE.get(family_name, 0.9), f"greedy tokens agree on {agree:.2%} only"


def test_sampler_int8_routes_each_token_as_the_fp32_experts_do(tiny_run, family_name):
    """With one expert forced per token, Int8Experts adds each expert's output where transformers' loop does."""
    if refuses_int8(tiny_run, family_name):
        return
    model = load_base_model(tiny_run).eval()
    experts = next(m for m in model.modules() if is_fused_experts(m))
    q = Int8Experts(experts)
    T, E, K = 10, experts.gate_up_proj.shape[0], 2
    x = torch.randn(T, experts.gate_up_proj.shape[2], generator=torch.Generator().manual_seed(1))
    index = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], dim=1)
    weights = torch.softmax(torch.randn(T, K, generator=torch.Generator().manual_seed(2)), dim=-1)
    with torch.no_grad():
        ref, got = experts(x, index, weights), q(x, index, weights)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert sampler(model, "int8") is not model


def test_an_int8_token_comes_out_the_same_one_at_a_time_as_in_one_pass(tiny_run, family_name):
    """Activations quantized per token: logits of a KV-cached decode, one token at a time (as a
    worker samples), match one teacher-forced pass over the same ids (as the trainer checks) to
    fp32's own rounding; per-tensor scales moved them by int8's whole error. And an Int8Linear's
    row is the same in any batch, bit for bit."""
    from transformers import DynamicCache

    from paths.work.quantize import Int8Linear
    from paths.work.sampling import cache_argument

    if refuses_int8(tiny_run, family_name):
        return
    layer = Int8Linear.of(nn.Linear(64, 96))
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3)) * torch.logspace(-2, 2, 9)[:, None]
    assert torch.equal(layer(x)[4:5], layer(x[4:5]))

    model = load_base_model(tiny_run).eval()
    q = int8_copy(model)
    ids = torch.randint(3, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    gaps = {}
    with torch.no_grad():
        for name, m in (("fp32", model), ("int8", q)):
            full = m(ids).logits
            kv = {cache_argument(m): DynamicCache()}  # the KV cache sampling keeps
            steps = [m(ids[:, t : t + 1], use_cache=True, **kv).logits for t in range(ids.shape[1])]
            gaps[name] = (torch.cat(steps, dim=1) - full).abs().max().item()
    assert gaps["int8"] <= max(1e-4, 20 * gaps["fp32"]), gaps
