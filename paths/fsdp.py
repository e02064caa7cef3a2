"""A path sharded over processes with FSDP2 (`torch.distributed.fsdp.fully_shard`): each decoder
layer is one unit whose parameters, gradients and AdamW moments live 1/N on each rank.

Checkpoints stay what every other checkpoint is (safetensors, index-keyed AdamW state, JSON): the
full state is gathered to rank 0 to write and handed to every rank to load, so a checkpoint
written by N ranks resumes on N, on another number of ranks, or on one process without FSDP.
torch's distributed checkpoint would write per-rank shards, but its metadata file is a pickle,
which no reader of a shared bucket should unpickle.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paths.errors import ConfigurationError


def shard(model: nn.Module, bf16: bool = False) -> nn.Module:
    """Shard every decoder layer, then the rest (embeddings, norm, head) as the root unit. `bf16`:
    each unit computes in bf16 over its fp32 shards, gradients reduced in fp32 (FSDP2's mixed
    precision, what accelerate's bf16 autocast is elsewhere)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers = [m for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and name.endswith("layers")]
    if not layers:
        raise ConfigurationError(f"--fsdp finds no decoder layers in {type(model).__name__}: train it without --fsdp")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for layer in layers[0]:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _full() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's index order (its groups' order)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for group in optimizer.param_groups for p in group["params"]]


def gather(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """(model state, optimizer state in torch's index-keyed form), whole, on rank 0 ({} and None
    elsewhere). Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights = get_model_state_dict(model, options=_full())
    if optimizer is None:
        return weights, None
    by_name = get_optimizer_state_dict(model, optimizer, options=_full())
    if not by_name:
        return weights, None
    names = _names(model, optimizer)
    index = {n: i for i, n in enumerate(names)}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]
    return weights, {"state": {index[n]: s for n, s in by_name["state"].items()}, "param_groups": groups}


def load(model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor], optim: dict[str, Any]) -> None:
    """Load a whole model and index-keyed optimizer state (every rank holds both) into the shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, dict(sorted(weights.items())), options=options)  # each tensor is scattered in turn: every rank in one order
    for group, saved in zip(optimizer.param_groups, optim["param_groups"]):  # keys a scheduler added (initial_lr) must exist to be loaded
        for key, value in saved.items():
            if key != "params":
                group.setdefault(key, value)
    names = _names(model, optimizer)
    by_name = {"state": {names[int(i)]: dict(sorted(s.items())) for i, s in sorted(optim["state"].items(), key=lambda kv: int(kv[0]))},  # one order on every rank, down to the moments
               "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[int(i)] for i in g["params"]]} for g in optim["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=options)
