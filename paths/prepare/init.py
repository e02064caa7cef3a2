"""Getting an MoE into a run: from a preset or config (`paths init`), from an existing MoE
checkpoint (`init --from`), or by sparse upcycling a dense model (`paths upcycle`).

The MoE is written to `base/` as transformers saves it (sharded safetensors + index + config),
with a manifest holding each file's sha256 and each tensor's (so ranged readers can check what
they read), and `run.json` records family, shape, checksum and tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

from paths.base import build_model, load_spec, preset_path
from paths.errors import ConfigurationError, NotFound, PathsError
from paths.families import Family, family_of_config, family_of_dense_config, fill
from paths.tokenizer import check_vocab, load_tokenizer, tokenizer_files, train_bpe
from storage.layout import Run, open_run
from storage.manifest import ArtifactWriter, sha256_hex
from storage.safetensors_io import read_header


MODEL_FILES = ("config.json", "generation_config.json")


MAX_SHARD = "1GB"


def hash_tensors(local_dir: str, family: Family, num_experts: int) -> dict[str, str]:
    """sha256 of every tensor's bytes; fused expert tensors also per expert slice ('name[e]'), and
    routers per row where a path keeps its expert's row (a "moe" path)."""
    from storage.url import open_store

    store = open_store(local_dir)
    out = {}
    from paths.base import NOT_WEIGHTS

    for fname in sorted(os.listdir(local_dir)):
        if not fname.endswith(".safetensors") or fname in NOT_WEIGHTS:
            continue
        tensors, _, _ = read_header(store, fname)
        with open(os.path.join(local_dir, fname), "rb") as f:
            for name, e in sorted(tensors.items(), key=lambda kv: kv[1].begin):
                f.seek(e.begin)
                data = f.read(e.nbytes)
                out[name] = hashlib.sha256(data).hexdigest()
                kind = family.classify(name).kind
                if kind == "fused" or (kind == "router" and not family.has_dense_sibling):
                    step = e.nbytes // num_experts
                    for x in range(num_experts):
                        out[f"{name}[{x}]"] = hashlib.sha256(data[x * step : (x + 1) * step]).hexdigest()
    return out


def write_base(run: Run, local_dir: str, family: Family, source: str) -> dict[str, Any]:
    """Upload an HF MoE checkpoint folder to base/ with per-file and per-tensor hashes; returns
    run.json's `base` entry."""
    config = json.load(open(os.path.join(local_dir, "config.json")))
    names = [f for f in sorted(os.listdir(local_dir)) if f.endswith(".safetensors") or f.endswith(".safetensors.index.json") or f in MODEL_FILES]
    writer = ArtifactWriter(run.store, run.base)
    for fname in names:
        writer.upload(fname, os.path.join(local_dir, fname))
    tensors = hash_tensors(local_dir, family, family.num_experts(config))
    manifest = writer.commit(kind="base", family=family.name, source=source, tensors=tensors)
    return {
        "family": family.name,
        "model_type": config["model_type"],
        "num_layers": config["num_hidden_layers"],
        "num_experts": family.num_experts(config),
        "checksum": sha256_hex(json.dumps(manifest["files"], sort_keys=True).encode()),
        "source": source,
    }


def write_tokenizer(run: Run, tokenizer: Any, source: str) -> dict[str, Any]:
    """Save the tokenizer under tokenizer/ with a manifest; returns run.json's `tokenizer` entry."""
    folder, files = tokenizer_files(tokenizer)
    try:
        writer = ArtifactWriter(run.store, run.tokenizer)
        for fname in files:
            writer.upload(fname, os.path.join(folder, fname))
        manifest = writer.commit(kind="tokenizer", source=source)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"source": source, "vocab_size": len(tokenizer), "checksum": sha256_hex(json.dumps(manifest["files"], sort_keys=True).encode())}


def _tokenizer_for(spec_vocab: int, model_vocab: int, tokenizer_dir: str | None, fallback_dir: str | None):
    """(tokenizer, source): the given one, one shipped with --from, or a BPE trained here."""
    if tokenizer_dir:
        tok, source = load_tokenizer(tokenizer_dir), f"dir:{os.path.abspath(tokenizer_dir)}"
    elif fallback_dir and any(os.path.exists(os.path.join(fallback_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        tok, source = load_tokenizer(fallback_dir), f"dir:{os.path.abspath(fallback_dir)}"
    else:
        tok, source = train_bpe(min(spec_vocab, model_vocab)), "trained:byte-level-bpe(stdlib)"
    check_vocab(tok, model_vocab, f"tokenizer ({source})")
    return tok, source


def _require_fresh(url: str, storage_options: dict | None) -> None:
    """Refuse a run that already has a base model (nothing is overwritten)."""
    try:
        run = open_run(url, storage_options)
    except NotFound:
        return
    if run.store.exists(f"{run.base}/manifest.json"):
        raise ConfigurationError(f"{run.url} already has a base model: use a new run folder or prefix")


def init_run(
    url: str,
    *,
    preset: str | None = None,
    config_file: str | None = None,
    from_dir: str | None = None,
    tokenizer_dir: str | None = None,
    seed: int = 0,
    storage_options: dict | None = None,
) -> dict[str, Any]:
    """`paths init`: validate everything, then write base/, tokenizer/ and run.json."""
    if sum(x is not None for x in (preset, config_file, from_dir)) != 1:
        raise ConfigurationError("paths init needs exactly one of --preset, --config or --from")
    if from_dir is not None:
        return _init_from_dir(url, from_dir, tokenizer_dir, storage_options)
    spec = load_spec(preset_path(preset), f"preset:{preset}") if preset else load_spec(config_file, f"config:{config_file}")
    tok, tok_source = _tokenizer_for(spec.tokenizer_vocab, spec.config["vocab_size"], tokenizer_dir, None)
    _require_fresh(url, storage_options)
    model = build_model(spec, seed)
    with tempfile.TemporaryDirectory(prefix="paths-base-") as tmp:
        model.save_pretrained(tmp, max_shard_size=MAX_SHARD)
        del model
        run = open_run(url, storage_options, create=True)
        base = write_base(run, tmp, spec.family, spec.source)
    meta = run.update_meta(base=base, tokenizer=write_tokenizer(run, tok, tok_source), seed=seed, dtype=spec.dtype)
    return meta


def _init_from_dir(url: str, from_dir: str, tokenizer_dir: str | None, storage_options: dict | None) -> dict[str, Any]:
    """Import an existing MoE checkpoint folder of a supported family."""
    config_path = os.path.join(from_dir, "config.json")
    if not os.path.exists(config_path):
        raise ConfigurationError(f"--from {from_dir}: no config.json there; give a Hugging Face checkpoint folder")
    config = json.load(open(config_path))
    family = family_of_config(config, f"--from {from_dir}")
    family.check_moe_config(config)
    weights = [f for f in os.listdir(from_dir) if f.endswith(".safetensors")]
    if not weights:
        raise ConfigurationError(f"--from {from_dir}: no .safetensors weights (pickled .bin files are refused: convert them first)")
    check_checkpoint(family, config, from_dir)
    tok, tok_source = _tokenizer_for(config["vocab_size"], config["vocab_size"], tokenizer_dir, from_dir)
    _require_fresh(url, storage_options)
    run = open_run(url, storage_options, create=True)
    base = write_base(run, from_dir, family, f"dir:{os.path.abspath(from_dir)}")
    return run.update_meta(base=base, tokenizer=write_tokenizer(run, tok, tok_source), dtype=config.get("dtype", config.get("torch_dtype")))


def check_checkpoint(family: Family, config: dict[str, Any], folder: str) -> None:
    """Every router and expert tensor the family's templates name for this config is in the
    folder's safetensors files, in the shape the config gives (one-line errors otherwise)."""
    from paths.base import meta_shapes
    from storage.url import open_store

    store = open_store(folder)
    tensors: dict[str, Any] = {}
    for fname in sorted(os.listdir(folder)):
        if fname.endswith(".safetensors"):
            tensors.update(read_header(store, fname)[0])
    cfg, memory = meta_shapes(family.moe_model_type, config, f"--from {folder}: config.json")
    experts = family.num_experts(config)
    for layer in family.sparse_layers(cfg):
        want: dict[str, tuple[int, ...]] = {fill(family.router["disk"], layer): memory[fill(family.router["memory"], layer)]}
        want.update({fill(t, layer): memory[fill(t, layer)] for t in family.router_extras})
        gate_up, down = memory[fill(family.experts_memory["gate_up"], layer)], memory[fill(family.experts_memory["down"], layer)]
        fused = {fill(t, layer): memory[fill(t, layer)] for t in family.experts_memory.values()}
        if family.path_experts > 1 and all(name in tensors for name in fused):
            raise ConfigurationError(f"--from {folder}: its experts are stored fused ({next(iter(fused))}); {family.name} paths need one tensor per expert "
                                     "and projection on disk: save the model with transformers' save_pretrained")
        if family.experts_disk and not all(name in tensors for name in fused):  # on disk one tensor per expert and projection
            for e in range(experts):
                want[family.disk_expert(layer, e, "gate")] = want[family.disk_expert(layer, e, "up")] = (gate_up[1] // 2, gate_up[2])
                want[family.disk_expert(layer, e, "down")] = tuple(down[1:])
        else:
            want.update(fused)
        for name, shape in want.items():
            if name not in tensors:
                raise ConfigurationError(f"--from {folder}: the checkpoint has no tensor {name}, which the {family.name} family names for layer {layer}: "
                                         f"export it with transformers' save_pretrained (or fix configs/families/{family.name}.toml)")
            if tuple(tensors[name].shape) != shape:
                raise ConfigurationError(f"--from {folder}: tensor {name} has shape {list(tensors[name].shape)}, its config.json gives {list(shape)}: "
                                         "the weights and config.json disagree (fix config.json, or re-export the checkpoint)")


def upcycle(
    url: str,
    from_dir: str,
    experts: int,
    top_k: int = 2,
    noise: float = 0.0,
    seed: int = 0,
    tokenizer_dir: str | None = None,
    storage_options: dict | None = None,
) -> dict[str, Any]:
    """Sparse upcycling (Komatsuzaki et al.): every expert a copy of the dense MLP (plus optional
    noise), the router small and random; written as the family's MoE checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if experts < 1 or not 1 <= top_k <= experts:
        raise ConfigurationError(f"--experts must be >= 1 and 1 <= --top-k <= --experts (got {experts}, {top_k})")
    config_path = os.path.join(from_dir, "config.json")
    if not os.path.exists(config_path):
        raise ConfigurationError(f"--from {from_dir}: no config.json there; give a Hugging Face checkpoint folder")
    dense_cfg = json.load(open(config_path))
    family = family_of_dense_config(dense_cfg, f"--from {from_dir}")
    moe_fields = family.moe_config(dense_cfg, experts, top_k)
    tok, tok_source = _tokenizer_for(dense_cfg["vocab_size"], dense_cfg["vocab_size"], tokenizer_dir, from_dir)
    _require_fresh(url, storage_options)

    dense = AutoModelForCausalLM.from_pretrained(from_dir, dtype="auto")
    dtype = next(dense.parameters()).dtype
    cfg = AutoConfig.for_model(family.moe_model_type, **{k: v for k, v in moe_fields.items() if k not in ("model_type", "architectures")})
    torch.manual_seed(seed)
    moe = AutoModelForCausalLM.from_config(cfg).to(dtype)
    dense_sd = dense.state_dict()
    moe_sd = moe.state_dict()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in moe_sd.items():
            role = family.classify(name)
            if role.kind == "shared":
                if name not in dense_sd:
                    raise PathsError(f"upcycle: dense checkpoint {from_dir} has no tensor {name}")
                tensor.copy_(dense_sd[name])
            elif role.kind == "router":
                tensor.copy_(torch.randn(tensor.shape, generator=g) * 0.02)
            elif role.kind == "fused":
                if role.part == "gate_up":
                    src = torch.cat([dense_sd[family.dense_mlp(role.layer, "gate")], dense_sd[family.dense_mlp(role.layer, "up")]])
                else:
                    src = dense_sd[family.dense_mlp(role.layer, "down")]
                for e in range(experts):
                    w = src.float()
                    if noise > 0:
                        w = w + noise * w.std() * torch.randn(w.shape, generator=g)
                    tensor[e].copy_(w.to(dtype))
    del dense, dense_sd
    with tempfile.TemporaryDirectory(prefix="paths-base-") as tmp:
        moe.save_pretrained(tmp, max_shard_size=MAX_SHARD)
        del moe
        run = open_run(url, storage_options, create=True)
        base = write_base(run, tmp, family, f"upcycle:{os.path.abspath(from_dir)}")
    return run.update_meta(
        base=base, tokenizer=write_tokenizer(run, tok, tok_source), upcycle={"experts": experts, "top_k": top_k, "noise": noise, "seed": seed}
    )


def init_plan(preset: str | None = None, config_file: str | None = None) -> dict[str, Any]:
    """What `paths init --dry-run` prints: the model a preset or config would build, as a one-level
    plan's table (family, layers, experts, parameters per path and in all); writes nothing."""
    from paths.base import spec_parameters
    from paths.prepare.decompose import summarize

    if not (preset or config_file):
        raise ConfigurationError("--dry-run works with --preset or --config: name the model to describe")
    spec = load_spec(preset_path(preset), preset) if preset else load_spec(config_file, config_file)
    from paths.base import full_config

    plan = spec.family.plan(full_config(spec.config), 1)
    return summarize(plan, spec.family.name, spec_parameters(spec), decomposed=False)
