"""An 8-bit actor for a full-precision learner (QuaRL): a copy of a model whose matrix multiplies
run in int8, weights quantized per output channel and activations per token as they come.

Per token, not per tensor: torch's dynamic quantization scaled a whole input tensor by its largest
value, so a token's rounding depended on the tokens it was batched with, and the same completion
came out differently sampled one token at a time (a KV cache) and checked in one teacher-forced
pass: an honest int8 worker missed its seeded draws by up to 0.33 of probability mass. Here a
token's row is quantized by its own scale and multiplied in int32 (`torch._int_mm`, exact), so
its output is the same in any batch.

transformers keeps a MoE layer's experts as fused 3-D parameters (`gate_up_proj` [E, 2I, H],
`down_proj` [E, H, I]) that no `nn.Linear` holds: left alone, the feed-forward half of every
layer, most of the arithmetic, would stay in fp32. `Int8Experts` takes each expert's two matrices
as int8 linear layers and runs transformers' eager routing loop over them. Routers (`mlp.gate`)
stay fp32: which expert a token goes to is not left to rounding.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from paths.errors import ConfigurationError


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8 (a scale per output channel) and each row of x quantized to
    int8 by its own largest value: one row's output does not depend on the other rows."""

    def __init__(self, weight_OI: torch.Tensor, bias_O: torch.Tensor | None = None):
        super().__init__()
        q_OI, scale_O1 = _rows_int8(weight_OI.detach().float())
        self.register_buffer("weight_OI", q_OI)
        self.register_buffer("scale_O", scale_O1.squeeze(1))
        self.register_buffer("bias_O", None if bias_O is None else bias_O.detach().float().clone())
        self.out_features, self.in_features = q_OI.shape

    @classmethod
    def of(cls, linear: nn.Linear) -> "Int8Linear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q_NI, scale_N1 = _rows_int8(x.reshape(-1, self.in_features).float())
        y_NO = torch._int_mm(q_NI, self.weight_OI.t()).float() * scale_N1 * self.scale_O
        if self.bias_O is not None:
            y_NO = y_NO + self.bias_O
        return y_NO.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias_O is not None}"


def _rows_int8(t_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row as int8 in [-127, 127] by its own largest magnitude: (int8 rows, scales (N, 1))."""
    scale_N1 = t_NK.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(t_NK / scale_N1).clamp(-127, 127).to(torch.int8), scale_N1


def _quantize(module: nn.Module) -> nn.Module:
    """Every nn.Linear under `module` (or `module` itself) as an Int8Linear."""
    if isinstance(module, nn.Linear):
        return Int8Linear.of(module)
    for name, child in list(module.named_children()):
        setattr(module, name, _quantize(child))
    return module


def _linears(weights_EOI: torch.Tensor) -> nn.ModuleList:
    return nn.ModuleList(Int8Linear(w_OI) for w_OI in weights_EOI)


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
    q = copy.deepcopy(model).to("cpu", torch.float32)  # int8 matrix multiplies run on the CPU
    for name, module in list(q.named_modules()):
        if name and is_fused_experts(module):
            parent, _, attr = name.rpartition(".")
            setattr(q.get_submodule(parent) if parent else q, attr, Int8Experts(module))
    return _quantize(q)
