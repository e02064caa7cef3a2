"""An 8-bit actor for a full-precision learner (QuaRL): a copy of a model whose matrix multiplies
run in int8 with dynamic activation quantization (fbgemm / qnnpack on CPU).

torch's `quantize_dynamic` converts `nn.Linear` layers only, and transformers keeps a MoE layer's
experts as fused 3-D parameters (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) that no
`nn.Linear` holds: left alone, the feed-forward half of every layer, most of the arithmetic,
would stay in fp32. `Int8Experts` takes each expert's two matrices as quantized linear layers
and runs transformers' eager routing loop over them. Routers (`mlp.gate`) stay fp32: which
expert a token goes to is not left to rounding.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from paths.errors import ConfigurationError


def _quantize(module: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice (its dynamic int8 Linear is what runs)
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8, inplace=True)


def _linears(weights_EOI: torch.Tensor) -> nn.ModuleList:
    layers = nn.ModuleList()
    for w_OI in weights_EOI.detach().float():
        layer = nn.Linear(w_OI.shape[1], w_OI.shape[0], bias=False)
        layer.weight = nn.Parameter(w_OI.clone(), requires_grad=False)
        layers.append(layer)
    return _quantize(layers)


def is_fused_experts(module: nn.Module) -> bool:
    return isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) and isinstance(getattr(module, "down_proj", None), torch.Tensor) \
        and module.gate_up_proj.dim() == 3


class Int8Experts(nn.Module):
    """Fused experts (Mixtral / Qwen3-MoE layout) as int8 linear layers, one pair per expert."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False) or not getattr(experts, "is_concatenated", True):
            raise ConfigurationError(f"int8 sampling (--dtype int8) takes experts stored as [E, 2I, H] / [E, H, I] without bias; {type(experts).__name__} is laid out "
                                     "otherwise: sample in fp32 or bf16")
        self.num_experts = experts.gate_up_proj.shape[0]
        self.act_fn = experts.act_fn
        self.gate_up = _linears(experts.gate_up_proj)
        self.down = _linears(experts.down_proj)

    def forward(self, hidden_states_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor) -> torch.Tensor:
        out_TH = torch.zeros_like(hidden_states_TH)
        for e in top_k_index_TK.unique().tolist():
            if not 0 <= e < self.num_experts:
                continue  # transformers' "no expert" slot
            token_T, slot_T = torch.where(top_k_index_TK == e)
            gate, up = self.gate_up[e](hidden_states_TH[token_T]).chunk(2, dim=-1)
            y = self.down[e](self.act_fn(gate) * up) * top_k_weights_TK[token_T, slot_T, None]
            out_TH.index_add_(0, token_T, y.to(out_TH.dtype))
        return out_TH


def int8_copy(model: nn.Module) -> nn.Module:
    """An fp32 copy of `model` with every linear layer and every fused expert in int8 (the original
    is untouched: the learner keeps it)."""
    q = copy.deepcopy(model).to("cpu", torch.float32)  # dynamic quantization runs on the CPU
    for name, module in list(q.named_modules()):
        if name and is_fused_experts(module):
            parent, _, attr = name.rpartition(".")
            setattr(q.get_submodule(parent) if parent else q, attr, Int8Experts(module))
    return _quantize(q)
