"""One MoE feed-forward block, two implementations, in the families' Hugging Face layout.

The weights stay transformers' own parameters (router `gate.weight` (E, H); experts
`gate_up_proj` (E, 2I, H), gate rows first, and `down_proj` (E, H, I)), so a patched model saves
back in its family's layout with `save_pretrained`. Only the block's forward is replaced:

- `reference`: pure torch, any device. Top-k of the softmax over router logits (renormalised for
  Mixtral, and for Qwen3-MoE when `norm_topk_prob`), tokens sorted by expert, one matmul pair per
  expert over its contiguous tokens, outputs scattered back with their routing weights;
- `megablocks`: megablocks' dropless `dMoE` (CUDA; `pip install '.[gpu]'`), weights copied in
  megablocks' layout (w1/v1/w2 of (E*I, H)) and copied back by `write_back()` before saving.

Both record each call's router logits (for the load-balancing loss). `auto` picks megablocks when
CUDA and the package are present, else the reference. A block holding more than its router and
routed experts (Qwen2-MoE's gated shared expert) keeps transformers' own forward under the
reference, its router's logits recorded by a hook; megablocks, which computes routed experts
only, refuses it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch
from torch import nn

from paths.errors import ConfigurationError
from paths.families import Family, fill

Backend = Literal["auto", "reference", "megablocks"]


def megablocks_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import megablocks  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: Backend) -> str:
    if backend == "auto":
        return "megablocks" if megablocks_available() else "reference"
    if backend == "megablocks" and not megablocks_available():
        raise ConfigurationError("--moe-backend megablocks needs CUDA and the megablocks package (pip install '.[gpu]'); use reference")
    if backend not in ("reference", "megablocks"):
        raise ConfigurationError(f"--moe-backend must be auto, reference or megablocks, got {backend!r}")
    return backend


@dataclass
class Block:
    """A family's MoE block inside a model: its module and its three parameters."""

    module: nn.Module
    router: nn.Parameter  # (E, H)
    gate_up: nn.Parameter  # (E, 2I, H)
    down: nn.Parameter  # (E, H, I)
    top_k: int
    normalize: bool
    act: object
    router_module: nn.Module
    logits: list[torch.Tensor] = field(default_factory=list)  # router logits of each call (T, E)

    def extras(self) -> list[str]:
        """The block's parameters besides its router and routed experts (a shared expert, its gate)."""
        own = {id(self.router), id(self.gate_up), id(self.down)}
        return [n for n, p in self.module.named_parameters() if id(p) not in own]


def blocks(model: nn.Module, family: Family) -> list[Block]:
    """Every layer's MoE block, located through the family's in-memory tensor names."""
    config = model.config
    out = []
    for layer in family.sparse_layers(config):
        router_name = fill(family.router["memory"], layer)
        module = model.get_submodule(router_name.rsplit(".", 2)[0])
        experts = model.get_submodule(fill(family.experts_memory["gate_up"], layer).rsplit(".", 1)[0])
        out.append(Block(
            module=module,
            router=model.get_parameter(router_name),
            gate_up=model.get_parameter(fill(family.experts_memory["gate_up"], layer)),
            down=model.get_parameter(fill(family.experts_memory["down"], layer)),
            top_k=int(getattr(config, family.top_k_field)),
            normalize=bool(getattr(config, "norm_topk_prob", True)),
            act=getattr(experts, "act_fn", None),  # None: the family's own activation (its block keeps transformers' forward)
            router_module=model.get_submodule(router_name.rsplit(".", 1)[0]),
        ))
    return out


def route(block: Block, h_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router logits (N, E), weights (N, k), expert ids (N, k)): top-k of the softmax."""
    logits = torch.nn.functional.linear(h_NH, block.router)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, index = torch.topk(probs, block.top_k, dim=-1)
    if block.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(h_NH.dtype), index


def reference_forward(block: Block, hidden_states: torch.Tensor) -> torch.Tensor:
    """The block in pure torch: tokens grouped by expert, one gate_up and one down matmul each."""
    shape = hidden_states.shape
    h = hidden_states.reshape(-1, shape[-1])  # (N, H)
    logits, weights, index = route(block, h)
    block.logits.append(logits)
    k = block.top_k
    flat = index.reshape(-1)  # (N*k,)
    order = torch.argsort(flat, stable=True)
    token = order // k  # the token of each sorted assignment
    counts = torch.bincount(flat, minlength=block.router.shape[0]).tolist()
    x = h[token]  # (N*k, H)
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            gate, up = torch.nn.functional.linear(x[start : start + n], block.gate_up[e]).chunk(2, dim=-1)
            outs.append(torch.nn.functional.linear(block.act(gate) * up, block.down[e]))
        start += n
    y = torch.cat(outs) * weights.reshape(-1)[order, None]
    out = torch.zeros_like(h).index_add_(0, token, y.to(h.dtype))
    return out.reshape(shape)


class MegablocksMoE(nn.Module):
    """megablocks' dMoE holding a copy of one block's weights (CUDA only)."""

    def __init__(self, block: Block):
        super().__init__()
        from megablocks.layers.arguments import Arguments
        from megablocks.layers.dmoe import dMoE

        E, two_i, H = block.gate_up.shape
        inter = two_i // 2
        args = Arguments(
            hidden_size=H, ffn_hidden_size=inter, moe_num_experts=E, moe_top_k=block.top_k, mlp_type="glu", mlp_impl="grouped",
            activation_fn=torch.nn.functional.silu, moe_normalize_expert_weights=1.0 if block.normalize else None, bias=False,
            return_bias=False, bf16=block.gate_up.dtype == torch.bfloat16, fp16=block.gate_up.dtype == torch.float16,
            device=block.gate_up.device, moe_loss_weight=0.0,
        )
        self.block, self.inter = block, inter
        self.moe = dMoE(args)
        with torch.no_grad():
            self.moe.router.layer.weight.copy_(block.router)
            self.moe.experts.mlp.w1.copy_(block.gate_up[:, :inter].reshape(E * inter, H))
            self.moe.experts.mlp.v1.copy_(block.gate_up[:, inter:].reshape(E * inter, H))
            self.moe.experts.mlp.w2.copy_(block.down.transpose(1, 2).reshape(E * inter, H))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = hidden_states.reshape(-1, hidden_states.shape[-1])
        self.block.logits.append(torch.nn.functional.linear(h, self.moe.router.layer.weight))
        out = self.moe(hidden_states.transpose(0, 1).contiguous())  # megablocks takes (T, B, H)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(0, 1).reshape(hidden_states.shape)

    @torch.no_grad()
    def write_back(self) -> None:
        E, two_i, H = self.block.gate_up.shape
        i = self.inter
        self.block.router.copy_(self.moe.router.layer.weight)
        self.block.gate_up[:, :i].copy_(self.moe.experts.mlp.w1.view(E, i, H))
        self.block.gate_up[:, i:].copy_(self.moe.experts.mlp.v1.view(E, i, H))
        self.block.down.copy_(self.moe.experts.mlp.w2.view(E, i, H).transpose(1, 2))


@contextlib.contextmanager
def patched(model: nn.Module, family: Family, backend: Backend = "auto") -> Iterator[list[Block]]:
    """Inside, every MoE block of `model` runs on the chosen implementation (weights shared with
    the model for the reference; copied in and written back on exit for megablocks)."""
    chosen = resolve_backend(backend)
    found = blocks(model, family)
    extras = found[0].extras() if found else []
    if extras and chosen == "megablocks":
        raise ConfigurationError(f"--moe-backend megablocks computes routed experts only; {family.name} blocks also hold {', '.join(extras)}: use --moe-backend reference")
    saved = [b.module.forward for b in found]
    engines: list[MegablocksMoE] = []
    hooks = []
    try:
        for b in found:
            if extras:  # transformers' own block (its shared expert with it); the router's logits recorded
                hooks.append(b.router_module.register_forward_hook(lambda m, args, out, b=b: b.logits.append(out[0] if isinstance(out, tuple) else out)))
            elif chosen == "reference":
                b.module.forward = lambda hidden_states, b=b: reference_forward(b, hidden_states)
            else:
                engine = MegablocksMoE(b)
                b.module.add_module("megablocks", engine)
                engines.append(engine)
                b.module.forward = engine.forward
        yield found
    finally:
        for h in hooks:
            h.remove()
        for engine in engines:
            engine.write_back()
        for b, forward in zip(found, saved):
            b.module.forward = forward
            if "megablocks" in b.module._modules:
                del b.module._modules["megablocks"]


def load_balancing_loss(found: list[Block]) -> torch.Tensor:
    """Switch Transformer's auxiliary loss over the recorded calls: E * sum_e f_e P_e, where f_e is
    the share of top-k assignments to expert e and P_e its mean router probability (per layer,
    averaged over layers). Clears the records."""
    losses = []
    for b in found:
        if not b.logits:
            continue
        logits = torch.cat(b.logits)  # (N, E)
        probs = torch.softmax(logits.float(), dim=-1)
        E = probs.shape[-1]
        index = torch.topk(probs, b.top_k, dim=-1).indices
        f = torch.nn.functional.one_hot(index, E).float().sum(1).mean(0) / b.top_k  # (E,)
        losses.append(E * (f * probs.mean(0)).sum())
        b.logits.clear()
    return torch.stack(losses).mean() if losses else torch.zeros(())
