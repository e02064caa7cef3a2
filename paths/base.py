"""The run's base model as data: model specs (presets, configs), parameter counts, building a model
from a spec, and reading base/ back (its config, its tensors' byte ranges, run.json's base entry).

Writing base/ is the prepare stage's (paths/prepare/init.py); loading weights is paths/models.py's.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from paths.errors import ConfigurationError, NotFound
from paths.families import CONFIGS, Family, get_family
from storage.layout import Run
from storage.manifest import read_manifest
from storage.safetensors_io import TensorEntry, read_header

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model to build: family, full MoE config dict, dtype, tokenizer size, where it came from."""

    family: Family
    config: dict[str, Any]
    dtype: str
    tokenizer_vocab: int
    source: str


def preset_path(name: str) -> str:
    """configs/models/<name>.toml, or a clear error listing the presets."""
    path = os.path.join(CONFIGS, "models", f"{name}.toml")
    if not os.path.exists(path):
        names = sorted(f[:-5] for f in os.listdir(os.path.join(CONFIGS, "models")) if f.endswith(".toml"))
        raise ConfigurationError(f"unknown preset {name!r}: choose one of {', '.join(names)}")
    return path


def load_spec(path: str, source: str) -> ModelSpec:
    """A model spec from a TOML file: `family`, `dtype`, `[config]`, `[tokenizer] vocab_size`."""
    try:
        with open(path, "rb") as f:
            d = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigurationError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"config file {path} is not valid TOML: {exc}") from None
    if "family" not in d or "config" not in d:
        raise ConfigurationError(f"config file {path} needs `family = ...` and a [config] table")
    family = get_family(d["family"])
    dtype = d.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ConfigurationError(f"{path}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    config = {**d["config"], "model_type": family.moe_model_type, "architectures": [family.moe_architecture]}
    family.check_moe_config(full_config(config))
    vocab = d.get("tokenizer", {}).get("vocab_size", config["vocab_size"])
    return ModelSpec(family, config, dtype, int(vocab), source)


def full_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config with transformers' defaults filled in (what save_pretrained would write)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    try:
        cfg = AutoConfig.for_model(config["model_type"], **fields)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"invalid {config['model_type']} config: {exc}") from None
    return {**cfg.to_dict(), "architectures": config.get("architectures")}


def count_parameters(shapes: dict[str, tuple[int, ...]], family: Family, num_experts: int) -> dict[str, int]:
    """Parameter counts by role from tensor shapes (disk or memory names): shared, router,
    experts per layer (one expert), and a path: shared + one expert per layer (+ a "moe" path's router
    and padding experts: what the path model holds)."""
    shared = router = extras = 0
    expert_layer: dict[int, int] = {}
    total = 0
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        total += n
        role = family.classify(name)
        if role.kind == "shared":
            shared += n
        elif role.kind == "router" and role.part == "extra":
            extras += n
        elif role.kind == "router":
            router += n
        elif role.kind == "expert" and role.expert == 0:
            expert_layer[role.layer] = expert_layer.get(role.layer, 0) + n
        elif role.kind == "fused":
            expert_layer[role.layer] = expert_layer.get(role.layer, 0) + n // num_experts
    per_layer = sum(expert_layer.values())
    path = shared + per_layer
    if family.path_form == "moe":  # its own class: a router (its expert's row, or zeros for each expert it holds) and any padding experts
        # a row router keeps its extras' rows (GPT-OSS's router bias, a parameter); a zero router fills them (DeepSeek-V3's selection bias, a buffer)
        own = (router + extras) // num_experts if family.path_router == "row" else router // num_experts * family.path_experts
        path += own + (family.path_experts - 1) * per_layer
    return {"total": total, "shared": shared, "router": router, "expert_per_layer_sum": per_layer, "path": path}


def meta_shapes(model_type: str, config: dict[str, Any], what: str) -> tuple[Any, dict[str, tuple[int, ...]]]:
    """(transformers config with the class's defaults, every tensor's in-memory shape) of an MoE
    config, without allocating it (a meta-device model); a one-line error for an invalid config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "transformers_version", "torch_dtype", "dtype")}
    try:
        cfg = AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"{what} is not a valid {model_type} config ({exc})") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return cfg, {k: tuple(v.shape) for k, v in model.state_dict().items()}


def spec_parameters(spec: ModelSpec) -> dict[str, int]:
    """Parameter counts of a spec without allocating it (a meta-device model)."""
    _, shapes = meta_shapes(spec.family.moe_model_type, spec.config, spec.source)
    return count_parameters(shapes, spec.family, spec.family.num_experts(spec.config))


def build_model(spec: ModelSpec, seed: int):
    """A randomly initialised MoE of the spec (seeded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in spec.config.items() if k not in ("model_type", "architectures")}
    cfg = AutoConfig.for_model(spec.family.moe_model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    return model.to(getattr(torch, spec.dtype))


# -- reading the base back --------------------------------------------------------------------
def base_config(run: Run) -> dict[str, Any]:
    """base/config.json."""
    from storage.manifest import read_verified

    return json.loads(read_verified(run.store, run.base, "config.json"))


NOT_WEIGHTS = ("momentum.safetensors",)  # a composed model's outer momentum, kept beside its weights


def base_tensors(run: Run, source: str | None = None) -> tuple[dict[str, TensorEntry], int]:
    """Every tensor of base/ (or of another MoE checkpoint of the run's family, `source`, e.g. a
    DiLoCo round's composed/round-<r>/) with its file and byte range (headers by ranged reads),
    and the header bytes read."""
    prefix = source or run.base
    manifest = read_manifest(run.store, prefix)
    out: dict[str, TensorEntry] = {}
    header_bytes = 0
    for fname in manifest["files"]:
        if fname.endswith(".safetensors") and fname not in NOT_WEIGHTS:
            tensors, _, n = read_header(run.store, f"{prefix}/{fname}")
            out.update(tensors)
            header_bytes += n
    if not out:
        raise NotFound(f"{run.store.url_of(prefix)} holds no safetensors weights: run `paths init` first")
    return out, header_bytes


def require_base(run: Run) -> dict[str, Any]:
    """run.json's base entry, or a clear error if the run has no model yet."""
    meta = run.read_meta()
    if "base" not in meta:
        raise NotFound(f"{run.url} has no base model: run `paths init {run.url} --preset tiny-mixtral` (or --from / upcycle) first")
    return meta
