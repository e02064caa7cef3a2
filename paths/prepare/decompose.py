"""`paths decompose`: cut the base MoE into paths, and `paths plan`'s description of the cut.

A path is only `paths/<id>/path.json` (plan, expert per layer, base checksum, parameter count); its
weights are read from `base/` when needed (`paths.models.materialize`, by ranged reads).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Iterator

from paths.base import base_tensors, count_parameters, require_base
from paths.errors import ConfigurationError
from paths.models import materialize, path_pieces
from paths.plan import Plan
from paths.units import run_plan
from storage.layout import Run
from storage.manifest import ArtifactWriter, read_manifest


def decompose(run: Run, levels: int, select: str = "all", materialize: bool = False) -> dict[str, Any]:
    """Write paths/<id>/path.json for the selected paths (and init/ checkpoints if asked)."""
    plan, family, config = run_plan(run, levels)
    meta = run.read_meta()
    if "plan" in meta and meta["plan"]["levels"] != levels:
        raise ConfigurationError(
            f"{run.url} is already decomposed with --levels {meta['plan']['levels']}: use a new run, or `paths next-round` for a new plan"
        )
    ids = plan.select(select)
    tensors, _ = base_tensors(run)
    shapes = {n: e.shape for n, e in tensors.items()}
    params = count_parameters(shapes, family, plan.num_experts)
    checksum = meta["base"]["checksum"]
    writer = ArtifactWriter(run.store, "paths")
    for files in _existing_path_files(run):
        writer.files.update(files)
    for pid in ids:
        experts = plan.experts_per_layer(pid)
        pieces = path_pieces(family, tensors, experts)
        writer.write_json(f"{pid}/path.json", {
            "path": pid,
            "plan": plan.to_json(),
            "experts": experts,
            "family": family.name,
            "base_checksum": checksum,
            "parameters": params["path"],
            "bytes": sum(p.source.nbytes for p in pieces),
        })
    writer.commit(kind="paths")
    run.update_meta(plan=plan.to_json())
    if materialize:
        for pid in ids:
            materialize_to_run(run, pid)
    return {"plan": plan.to_json(), "paths": ids, "parameters_per_path": params["path"]}


def _existing_path_files(run: Run) -> Iterator[dict[str, Any]]:
    """Entries of an earlier paths/manifest.json, so decomposing more paths keeps the old ones."""
    if run.store.exists("paths/manifest.json"):
        yield read_manifest(run.store, "paths")["files"]


def materialize_to_run(run: Run, path_id: str) -> None:
    """Write paths/<id>/init/ (a standalone dense checkpoint) into the run, with a manifest."""
    tmp = tempfile.mkdtemp(prefix="paths-mat-")
    try:
        materialize(run, path_id, tmp)
        writer = ArtifactWriter(run.store, run.path_init(path_id))
        for name in sorted(os.listdir(tmp)):
            writer.upload(name, os.path.join(tmp, name))
        writer.commit(kind="path-init", path=path_id)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def describe(run: Run, levels: int | None = None) -> dict[str, Any]:
    """What `paths plan` shows: levels, layers per level, paths, parameters per path and in all."""
    meta = require_base(run)
    if levels is None and "plan" not in meta:
        levels = 1
    plan, family, _ = run_plan(run, levels)
    tensors, _ = base_tensors(run)
    params = count_parameters({n: e.shape for n, e in tensors.items()}, family, plan.num_experts)
    return summarize(plan, family.name, params, decomposed="plan" in meta)


def describe_config(config_file: str, levels: int = 1, micro_batch: int = 1, seq_len: int = 2048, lora_rank: int = 16, device_gib: float | None = None,
                    devices: int = 8) -> dict[str, Any]:
    """`paths plan --config`: the plan of a published MoE config (a Hugging Face config.json, no
    weights), with parameters per path and the memory to train one path in each mode."""
    import json
    import math

    from paths.base import meta_shapes
    from paths.families import family_of_config, fill

    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"--config {config_file}: not a readable config.json ({exc})") from None
    if lora_rank < 1 or devices < 2 or (device_gib is not None and device_gib <= 0):
        raise ConfigurationError(f"--lora-rank must be >= 1, --devices >= 2 and --device-memory > 0, got {lora_rank}, {devices} and {device_gib}")
    family = family_of_config(config, f"--config {config_file}")
    cfg, shapes = meta_shapes(family.moe_model_type, config, f"--config {config_file}")
    full = cfg.to_dict()  # with the class's defaults: a field left out may still make dense layers
    family.check_moe_config(full)
    plan = family.plan(full, levels)
    params = count_parameters(shapes, family, plan.num_experts)
    first = plan.sparse_layers[0]
    gate_up = shapes[fill(family.experts_memory["gate_up"], first)]
    width = gate_up[1] * gate_up[2] // (2 * cfg.hidden_size)  # [E, 2I, H] or GPT-OSS's [E, H, 2I]
    block = fill(family.router["memory"], first).rsplit(".", 2)[0] + "."
    shared_mlp = sum(math.prod(s) for n, s in shapes.items() if n.startswith(block) and family.classify(n).kind == "shared")  # a shared expert (and its gate)
    width += shared_mlp // (3 * cfg.hidden_size)
    out = summarize(plan, family.name, params, decomposed=False)
    out.update(config=config_file, path_form=family.path_form,
               memory=memory_plan(params["path"], cfg, width, micro_batch, seq_len, lora_rank, devices=devices), micro_batch=micro_batch, seq_len=seq_len)
    if device_gib is not None:
        out.update(device_memory=device_gib, fits=fitting_mode(out["memory"], device_gib))
    return out


def memory_plan(path_params: int, cfg: Any, expert_width: int, micro_batch: int, seq_len: int, lora_rank: int = 16,
                adapted: tuple[int, int] | None = None, devices: int = 8) -> dict[str, dict[str, float]]:
    """GiB to train one path in each mode: weights, gradients and AdamW's two moments (exact from
    the parameter count), and activations (an estimate after Korthikanti et al. 2022, no
    recomputation: per layer and token 18H + 8I bytes at 16 bits for a SwiGLU block of width I (the
    expert's, plus a shared expert's), the attention scores not kept (SDPA / flash attention); plus
    the logits and their softmax in fp32). The total is weights + moments + the larger of gradients
    and activations (backward frees a layer's activations as it makes its gradients); the
    framework's own buffers (a CUDA context, CPU thread pools) come on top.

    The FSDP row is one of `devices` devices holding 1/N of the weights, gradients and moments (fp32,
    FSDP2 as `--fsdp` shards: one unit per decoder layer, the rest as the root unit) plus what is
    gathered whole: the root unit through forward and backward, and two layers at a time (the one
    running and the one prefetched), with their unsharded gradients.

    LoRA rows: the adapter (rank `lora_rank` beside the attention and the path's expert MLPs)
    trains, with fp32 moments; the base is frozen, in fp32, int8 (one byte a weight of the decoder
    blocks' linear layers, a scale per row) or NF4 (half a byte, double-quantized scales).
    `adapted` = (adapter parameters at rank 1, parameters of the decoder blocks' linear layers);
    estimated from the config when not given."""
    H, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    tokens = micro_batch * seq_len
    act16 = L * tokens * (18 * H + 8 * expert_width) + 2 * tokens * V * 4
    if adapted is None:
        heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or H // heads
        attention = (H + heads * head_dim) * 2 + (H + kv * head_dim) * 2  # q, o, k, v: in + out each
        per_rank = L * (attention + 3 * (H + expert_width))
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        adapted = (per_rank, max(0, path_params - V * H * (1 if tied else 2)))
    per_rank, linear = adapted
    lora = per_rank * lora_rank
    frozen_rest = path_params - linear
    n, layer = max(1, devices), linear / max(1, L)
    gib = float(1 << 30)
    trainable = {"gradients": 4 * lora, "optimizer": 8 * lora, "activations": 2 * act16}
    modes = {
        "fp32 AdamW": {"weights": 4 * path_params, "gradients": 4 * path_params, "optimizer": 8 * path_params, "activations": 2 * act16},
        "bf16 mixed": {"weights": 4 * path_params, "gradients": 4 * path_params, "optimizer": 8 * path_params, "activations": act16},
        f"FSDP x{devices}, fp32": {"weights": 4 * path_params / n + 4 * (frozen_rest + 2 * layer) * (n - 1) / n, "gradients": 4 * path_params / n + 4 * (frozen_rest + layer) * (n - 1) / n,
                                    "optimizer": 8 * path_params / n, "activations": 2 * act16},
        f"LoRA r{lora_rank}": {"weights": 4 * path_params + 4 * lora, **trainable},
        f"LoRA r{lora_rank}, int8 base": {"weights": linear * (1 + 4 / max(1, H)) + 4 * frozen_rest + 4 * lora, **trainable},
        f"LoRA r{lora_rank}, nf4 base": {"weights": linear * (0.5 + 0.127 / 8) + 4 * frozen_rest + 4 * lora, **{**trainable, "activations": act16}},
    }
    # backward frees each layer's activations as it makes its gradients: the peak holds the larger of the two
    return {mode: {**{k: v / gib for k, v in parts.items()}, "total": (parts["weights"] + parts["optimizer"] + max(parts["gradients"], parts["activations"])) / gib}
            for mode, parts in modes.items()}


def fitting_mode(memory: dict[str, dict[str, float]], device_gib: float) -> str | None:
    """The first mode, from a full fine-tune down to the most frugal adapter, whose total fits."""
    return next((mode for mode, m in memory.items() if m["total"] <= device_gib), None)


def summarize(plan: Plan, family: str, params: dict[str, int], decomposed: bool) -> dict[str, Any]:
    """The plan table's content from a plan and parameter counts."""
    return {
        "family": family,
        "decomposed": decomposed,
        "levels": plan.levels,
        "layers_per_level": [len(r) for r in plan.level_layers],
        "level_layers": [[r.start, r.stop - 1] for r in plan.level_layers],
        "experts_per_layer": plan.num_experts,
        "paths": plan.num_paths,
        "parameters_per_path": params["path"],
        "parameters_total": params["total"],
        "parameters_shared": params["shared"],
        "example_path": plan.path_id(tuple([0] * plan.levels)),
    }
