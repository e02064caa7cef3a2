"""Domain experts (HDEE, Branch-Train-Merge): dense causal LMs of any size that share the run's
tokenizer, each registered for one domain with its own step budget.

An expert is `experts/<name>/expert.json` (domain, source, step budget, config summary, parameter
count, tokenizer checksum) plus its starting weights in `experts/<name>/init/` (an HF checkpoint),
under one manifest. It is claimed and trained like a path (`paths claim`, `paths train`): its
lease, checkpoints and `final/` live under `claims/<name>.json` and `work/<name>/`. Its data is the
dataset's shard named after the expert, or else after its domain (`paths shard --targets domains`
writes one shard per registered domain, which every expert of that domain reads).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any

from paths.errors import ConfigurationError, NotFound
from paths.units import PATH_ID, expert_info
from storage.layout import Run
from storage.manifest import ArtifactWriter

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "experts")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")


def presets() -> list[str]:
    """Dense expert sizes in configs/experts/."""
    return sorted(f[:-5] for f in os.listdir(PRESETS) if f.endswith(".toml"))


def add_expert(
    run: Run,
    name: str,
    domain: str,
    *,
    from_dir: str | None = None,
    preset: str | None = None,
    branch_from: str | None = None,
    steps: int | None = None,
    seed: int = 0,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Register a domain expert; returns its expert.json."""
    from transformers.utils import logging as hf_logging

    from paths.models import run_tokenizer

    hf_logging.disable_progress_bar()
    if not _NAME.fullmatch(name) or PATH_ID.fullmatch(name):
        raise ConfigurationError(f"expert name {name!r}: use letters, digits, '.', '_', '-', starting with a letter, and not a path id like p03")
    if not domain or not domain.strip():
        raise ConfigurationError(f"expert {name}: --domain is empty: name the domain whose documents it trains on")
    from storage.layout import validate_name

    validate_name("domain", domain)  # it names the domain's shard
    if sum(x is not None for x in (from_dir, preset, branch_from)) != 1:
        raise ConfigurationError(f"expert {name}: give exactly one of --from DIR, --preset SIZE or --branch-from EXPERT")
    if steps is not None and steps <= 0:
        raise ConfigurationError(f"expert {name}: --steps must be > 0, got {steps}")
    prefix = run.expert(name)
    if run.store.exists(f"{prefix}/manifest.json") and not overwrite:
        raise ConfigurationError(f"expert {name} already exists in {run.url}: pass --overwrite or choose another --name")
    tokenizer, tok_checksum = run_tokenizer(run)
    with tempfile.TemporaryDirectory(prefix=f"paths-expert-{name}-") as tmp:
        init = os.path.join(tmp, "init")
        if preset is not None:
            source = _from_preset(run, preset, init, seed)
        elif from_dir is not None:
            source = _from_dir(name, from_dir, init, tokenizer)
        else:
            source = _branch(run, name, branch_from, init)
        tokenizer.save_pretrained(init)
        config = json.load(open(os.path.join(init, "config.json")))
        if config.get("vocab_size", 0) < len(tokenizer):
            raise ConfigurationError(f"expert {name}: its vocab_size {config.get('vocab_size')} is smaller than the run's tokenizer ({len(tokenizer)} tokens): experts must share the run's tokenizer")
        info = {
            "name": name, "domain": domain, "source": source, "steps": steps, "tokenizer_checksum": tok_checksum,
            "parameters": _parameters(init), "created_at": time.time(),
            "config": {k: config.get(k) for k in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")},
        }
        with open(os.path.join(init, "expert.json"), "w") as f:
            json.dump(info, f, indent=2)
        if overwrite:
            run.store.delete_prefix(prefix)
        writer = ArtifactWriter(run.store, prefix)
        for fname in sorted(os.listdir(init)):
            writer.upload(f"init/{fname}", os.path.join(init, fname))
        writer.write_json("expert.json", info)
        writer.commit(kind="expert", name=name, domain=domain)
    return info


def _parameters(folder: str) -> int:
    from safetensors import safe_open

    total = 0
    for fname in os.listdir(folder):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(folder, fname), framework="pt") as f:
                for key in f.keys():
                    n = 1
                    for d in f.get_slice(key).get_shape():
                        n *= d
                    total += n
    return total


def _from_preset(run: Run, preset: str, out: str, seed: int) -> dict[str, Any]:
    """A fresh dense model of the base family's dense sibling, sized by configs/experts/<preset>."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from paths.base import base_config, require_base
    from paths.families import get_family

    path = os.path.join(PRESETS, f"{preset}.toml")
    if not os.path.exists(path):
        raise ConfigurationError(f"unknown expert preset {preset!r}: choose one of {', '.join(presets())} (configs/experts/)")
    with open(path, "rb") as f:
        spec = tomllib.load(f)
    meta = require_base(run)
    family = get_family(meta["base"]["family"])
    base = base_config(run)
    fields = {k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "rms_norm_eps", "rope_parameters") if k in base}
    fields.update(spec["config"])
    config = AutoConfig.for_model(spec.get("model_type", family.dense_model_type), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    return {"kind": "preset", "preset": preset, "seed": seed}


def _from_dir(name: str, folder: str, out: str, tokenizer: Any) -> dict[str, Any]:
    """A dense HF causal LM folder; its tokenizer, if it ships one, must be the run's."""
    from transformers import AutoTokenizer

    config_path = os.path.join(folder, "config.json")
    if not os.path.exists(config_path):
        raise ConfigurationError(f"expert {name}: --from {folder} has no config.json: give a Hugging Face checkpoint folder")
    config = json.load(open(config_path))
    if not any(a.endswith("ForCausalLM") for a in config.get("architectures") or []):
        raise ConfigurationError(f"expert {name}: --from {folder} is a {config.get('architectures')} model, not a causal LM")
    weights = [f for f in os.listdir(folder) if f.endswith(".safetensors") or f.endswith(".safetensors.index.json")]
    if not weights:
        raise ConfigurationError(f"expert {name}: --from {folder} has no .safetensors weights (pickled .bin files are refused: convert them first)")
    if any(os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        theirs = AutoTokenizer.from_pretrained(folder)
        if theirs.get_vocab() != tokenizer.get_vocab():
            raise ConfigurationError(f"expert {name}: the tokenizer in {folder} ({len(theirs)} tokens) differs from the run's ({len(tokenizer)} tokens): experts must share the run's tokenizer")
    os.makedirs(out)
    for fname in [*weights, "config.json", "generation_config.json"]:
        if os.path.exists(os.path.join(folder, fname)):
            shutil.copy(os.path.join(folder, fname), os.path.join(out, fname))
    return {"kind": "dir", "dir": os.path.abspath(folder)}


def _branch(run: Run, name: str, parent: str, out: str) -> dict[str, Any]:
    """Branch-Train-Merge: start from another expert's trained weights."""
    from paths.models import fetch_final

    parent_info = expert_info(run, parent)  # a clear error if it is not an expert
    try:
        provenance = fetch_final(run, parent, out)
    except NotFound:
        raise ConfigurationError(f"expert {name}: --branch-from {parent}, but {parent} has no final/ yet: train it first") from None
    for fname in ("provenance.json", "path.json", "expert.json", "manifest.json"):
        if os.path.exists(os.path.join(out, fname)):
            os.remove(os.path.join(out, fname))
    return {"kind": "branch", "from": parent, "parent_steps": provenance.get("steps"), "parent_domain": parent_info["domain"]}
