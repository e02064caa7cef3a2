"""Routing overrides on transformers' MoE blocks, located through the family's tensor names."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from paths.families import Family, fill


@contextlib.contextmanager
def forced_routing(model: torch.nn.Module, family: Family, experts: list[int]) -> Iterator[None]:
    """Inside the block, layer l's router sends every token to expert experts[l] with weight 1 (the
    family's forced weight: routed_scaling_factor for DeepSeek-V3's router): the MoE then computes
    exactly what the path choosing those experts computes."""
    routed = [(layer, e) for layer, e in enumerate(experts) if e >= 0]  # -1: a dense layer
    routers = [model.get_submodule(fill(family.router["memory"], layer).rsplit(".", 1)[0]) for layer, _ in routed]
    saved = [r.forward for r in routers]
    weight = family.forced_weight(model.config)

    def make(router: torch.nn.Module, expert: int):
        def forward(hidden_states: torch.Tensor):
            h = hidden_states.reshape(-1, router.weight.shape[1])  # (T, H)
            logits = torch.nn.functional.linear(h.to(router.weight.dtype), router.weight)  # (T, E): float32 where the family keeps its router so
            index = torch.full((h.shape[0], 1), expert, dtype=torch.long, device=h.device)  # (T, 1)
            weights = torch.full((h.shape[0], 1), weight, dtype=logits.dtype, device=h.device)  # (T, 1)
            return logits, weights, index

        return forward

    try:
        for router, (_, expert) in zip(routers, routed):
            router.forward = make(router, expert)
        yield
    finally:
        for router, forward in zip(routers, saved):
            router.forward = forward
