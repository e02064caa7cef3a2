"""LoRA adapters (peft) over a frozen path, whose base may be held in int8 (CPU or GPU) or 4-bit
NF4 (bitsandbytes, CUDA only).

A LoRA unit trains only A (r x in) and B (out x r) beside chosen linear layers: W' = W + s B A,
s = alpha / r. Its checkpoints hold the adapter and its optimizer state; the base is read again from
base/ (or the stage's final/) on resume. `final/` holds the merged weights, so compose, eval and a
next round take an adapter-trained path as any other.

Targets: `attention` (every linear layer of the attention blocks), `experts` (the path's expert
MLPs: the layers that compose into the MoE's experts), or module names (`q_proj`, or a full
`model.layers.0.mlp.gate_proj`). Merging is `merge` here, the same arithmetic as peft's merge, so
the trainer, rollout workers and compose all compute the same merged tensors.

Shapes: A_RI (rank x in), B_OR (out x rank), W_OI.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from paths.errors import ConfigurationError

ATTENTION, EXPERTS = "attention", "experts"
BASES = ("fp32", "int8", "nf4")
PREFIX = "base_model.model."  # peft's wrapper names a module of the model


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """What a LoRA unit trains: rank, alpha, dropout, target layers, and how its frozen base is held."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ()  # () : attention and experts (experts only under --freeze shared)
    base: str = "fp32"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigurationError(f"--lora rank must be >= 1, got {self.rank}: e.g. --lora 16 (0 turns adapters off)")
        if self.alpha <= 0:
            raise ConfigurationError(f"lora_alpha must be > 0, got {self.alpha}: e.g. --set lora_alpha={2 * self.rank}")
        if not 0 <= self.dropout < 1:
            raise ConfigurationError(f"lora_dropout must be in [0, 1), got {self.dropout}")
        if self.base not in BASES:
            raise ConfigurationError(f"--quantize-base must be one of {', '.join(BASES)}, got {self.base!r}")

    @property
    def scale(self) -> float:
        """s in W + s B A."""
        return self.alpha / self.rank

    def to_json(self) -> dict[str, Any]:
        """What a checkpoint and a policy version record of the adapter (resume must match it)."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets), "base": self.base}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LoraSpec":
        return cls(rank=int(d["rank"]), alpha=float(d["alpha"]), dropout=float(d["dropout"]), targets=tuple(d["targets"]), base=str(d["base"]))


def spec_of(cfg: Any) -> LoraSpec | None:
    """The adapter a training config asks for (lora_rank > 0), or None for a full fine-tune."""
    if cfg.lora_rank == 0:
        if cfg.quantize_base != "fp32":
            raise ConfigurationError(f"--quantize-base {cfg.quantize_base} freezes the base under an adapter: add --lora RANK (e.g. --lora 16)")
        return None
    targets = tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip())
    return LoraSpec(rank=cfg.lora_rank, alpha=cfg.lora_alpha or 2.0 * cfg.lora_rank, dropout=cfg.lora_dropout, targets=targets, base=cfg.quantize_base)


def target_modules(model: nn.Module, spec: LoraSpec, expert_params: Iterable[str], frozen_shared: bool, unit: str) -> list[str]:
    """The linear layers the adapter goes beside, by module name; one line naming the fix when a
    target matches nothing, is not a linear layer, or breaks --freeze shared."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    expert_modules = [p.removesuffix(".weight") for p in expert_params]
    targets = spec.targets or ((EXPERTS,) if frozen_shared else (ATTENTION, EXPERTS))
    chosen: list[str] = []
    for target in targets:
        if target == ATTENTION:
            found = [n for n in linears if ".self_attn." in n]
        elif target == EXPERTS:
            fused = [n for n in expert_modules if n not in linears]
            if fused:
                raise ConfigurationError(f"--lora target experts: {fused[0]} of {unit} is a fused expert tensor, not a linear layer: adapt it with --set lora_targets=attention, "
                                         "or train it fully (no --lora)")
            found = expert_modules
        else:
            found = [n for n in linears if n == target or n.endswith("." + target)]
        if not found:
            raise ConfigurationError(f"--lora target {target!r} matches no linear layer of {unit}: use attention, experts, or a module name such as q_proj "
                                     f"(e.g. {next(iter(linears), 'none')})")
        chosen += [n for n in found if n not in chosen]
    if frozen_shared:
        shared = [n for n in chosen if n not in expert_modules]
        if shared:
            raise ConfigurationError(f"--freeze shared keeps {shared[0]} the base's, so no adapter may go beside it: use --set lora_targets=experts")
    for name in chosen:
        layer = linears[name]
        if spec.rank > min(layer.in_features, layer.out_features):
            raise ConfigurationError(f"--lora rank {spec.rank} is larger than {name} of {unit} ({layer.out_features} x {layer.in_features}): "
                                     f"use a rank <= {min(layer.in_features, layer.out_features)}")
    return chosen


def attach(model: nn.Module, spec: LoraSpec, modules: list[str]) -> nn.Module:
    """`model` wrapped by peft with a fresh adapter beside `modules` (B = 0: the same function as
    the base); every base parameter frozen; an int8 base quantized in place."""
    import peft

    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=modules, bias="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers for a renamed attribute
        wrapped = peft.get_peft_model(model, config)
    if spec.base == "int8":
        quantize_int8(wrapped)
        with torch.no_grad():  # the rest in memory of its own: a weights file mapped by the loader is let go
            for t in [*wrapped.parameters(), *wrapped.buffers()]:
                if t.dtype.is_floating_point:
                    t.data = t.data.clone()
    return wrapped


def is_adapted(model: nn.Module) -> bool:
    """Whether `model` is a peft-wrapped LoRA unit."""
    return hasattr(model, "peft_config")


def _plain(name: str) -> str:
    """A parameter's name in the model under the adapter (peft's wrapper and base_layer left out)."""
    return name.removeprefix(PREFIX).replace(".base_layer.", ".")


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Everything the unit trains: the adapter's A and B (`<module>.lora_A.weight`, by the model's
    own module names) and any parameter trained in full beside it (finetune-moe's routers)."""
    import peft

    out = {k.removeprefix(PREFIX): v.detach() for k, v in peft.get_peft_model_state_dict(model).items()}
    out.update({_plain(n): p.detach() for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n})
    return out


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Load what `adapter_state` saved; one line when it is another adapter (rank, targets)."""
    import peft

    mine = adapter_state(model)
    if set(mine) != set(state) or any(mine[k].shape != state[k].shape for k in mine):
        raise ConfigurationError(f"{what} holds an adapter of other targets or rank than this run's: resume with the --lora and lora_targets it was trained with")
    peft.set_peft_model_state_dict(model, {PREFIX + k: v for k, v in state.items() if ".lora_" in k})
    full = {_plain(n): p for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n}
    with torch.no_grad():
        for name, p in full.items():
            p.copy_(state[name])


def merge(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The base's tensors with the adapter merged in (W + s B A in fp32, peft's arithmetic) and the
    fully trained ones replaced; new tensors where they changed, the others shared with `base`."""
    out = dict(base)
    for key, value in adapter.items():
        if ".lora_" not in key:
            out[key] = value.to(base[key].dtype)
        elif key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            a_RI, b_OR, w_OI = value, adapter[f"{module}.lora_B.weight"], base[f"{module}.weight"]
            out[f"{module}.weight"] = (w_OI.float() + (b_OR.float() @ a_RI.float()) * scale).to(w_OI.dtype)
    return out


def merged_state(model: nn.Module, spec: LoraSpec) -> dict[str, torch.Tensor]:
    """The adapted model's merged weights, by the model's own names (an fp32 base only: a quantized
    base merges into the fp32 weights it was made from, read again)."""
    if spec.base != "fp32":
        raise ConfigurationError(f"a {spec.base} base cannot be merged in place: merge into the fp32 weights it was quantized from")
    base = {_plain(k): v for k, v in model.state_dict().items() if ".lora_" not in k}
    return merge(base, adapter_state(model), spec.scale)


# -- an int8 frozen base on any device ------------------------------------------------------------
class _Int8MatMul(torch.autograd.Function):
    """y = x (q s)^T with the weight kept int8: the dequantized matrix lives only inside forward and
    backward, never among the tensors saved for backward."""

    @staticmethod
    def forward(ctx: Any, x_TI: torch.Tensor, q_OI: torch.Tensor, s_O: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(q_OI, s_O)
        return (x_TI @ q_OI.to(x_TI.dtype).T) * s_O.to(x_TI.dtype)

    @staticmethod
    def backward(ctx: Any, g_TO: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        q_OI, s_O = ctx.saved_tensors
        return (g_TO * s_O.to(g_TO.dtype)) @ q_OI.to(g_TO.dtype), None, None


class Int8Linear(nn.Module):
    """A frozen linear layer held as int8 with one fp32 scale per output row (absmax / 127)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w_OI = linear.weight.detach().float()
        s_O = w_OI.abs().amax(dim=1).clamp_min(1e-12) / 127
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", torch.round(w_OI / s_O[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", s_O)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Int8MatMul.apply(x.reshape(-1, self.in_features), self.qweight, self.scale).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def quantize_int8(model: nn.Module) -> int:
    """Every frozen linear layer of the decoder blocks (beside an adapter or not) as Int8Linear;
    embeddings, norms and the head stay as they are. Returns how many were quantized."""
    count = 0
    for name, module in list(model.named_modules()):
        if ".layers." not in f".{name}." or not isinstance(module, nn.Linear) or module.weight.requires_grad:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, Int8Linear(module))
        count += 1
    return count


def load_nf4(folder: str, device: Any) -> nn.Module:
    """A path loaded with its linear layers in bitsandbytes' 4-bit NF4 (QLoRA), prepared for
    training an adapter over it. CUDA only."""
    if not torch.cuda.is_available():
        raise ConfigurationError("--quantize-base nf4 needs CUDA (bitsandbytes 4-bit): on CPU use --quantize-base int8")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigurationError("--quantize-base nf4 needs bitsandbytes: pip install 'paths[gpu]', or use --quantize-base int8") from None
    import peft
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, device_map={"": device}, dtype=torch.float32)
    return peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
