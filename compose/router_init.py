"""`paths compose --router centroid|domain-embed`: each layer's router rows from the routed data.

Row e of layer l's router becomes the mean hidden state entering that layer's MoE block over the
documents that were routed to expert e (the documents of every path whose choice at l's level is
e), normalised and scaled to the layer's mean row norm, so token-level routing agrees with where
each expert was trained. Experts that no document reached keep their row.

centroid runs the documents through the composed model; domain-embed (FlexOlmo) through each
path's own trained model, so every owner's row depends on its own expert and data only: leaving a
path out changes no other expert's row.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from paths.errors import ConfigurationError
from paths.families import fill
from storage.layout import Run

if TYPE_CHECKING:
    from paths.families import Family
    from paths.plan import Plan


@torch.no_grad()
def centroid_rows(run: Run, folder: str, family: Family, plan: Plan, dataset: str, max_docs: int = 64, max_tokens: int = 256, paths: list[str] | None = None, keep: list[list[int]] | None = None) -> tuple[dict[int, torch.Tensor], dict[str, int]]:
    """{layer: router weight (E, H)} from the model in `folder`, and documents used per path
    (`paths`: only these; `keep[l]`: the model's experts of layer l by old id, after an opt-out)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from sharding.dataset import read_documents

    hf_logging.disable_progress_bar()
    manifest = _documents(run, dataset)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    layers = plan.sparse_layers
    routers = {layer: model.get_submodule(fill(family.router["memory"], layer).rsplit(".", 1)[0]) for layer in layers}  # a dense layer has none
    E = routers[layers[0]].weight.shape[0]
    index = {layer: {old: new for new, old in enumerate(keep[layer])} if keep else {e: e for e in range(E)} for layer in layers}
    sums = {layer: torch.zeros(E, routers[layer].weight.shape[1], dtype=torch.float64) for layer in layers}
    counts = {layer: torch.zeros(E, dtype=torch.float64) for layer in layers}
    current: dict[str, Any] = {}

    def hook(layer: int):
        def capture(module: torch.nn.Module, args: Any, output: Any):
            h = args[0].reshape(-1, args[0].shape[-1]).double()  # (T, H): the tokens entering the block
            e = index[layer][current["experts"][layer]]
            sums[layer][e] += h.sum(0)
            counts[layer][e] += h.shape[0]

        return capture

    handles = [routers[layer].register_forward_hook(hook(layer)) for layer in layers]
    used = {}
    try:
        for pid in sorted(p for p in manifest["paths"] if paths is None or p in paths):
            docs = read_documents(run, dataset, pid)[:max_docs]
            if not docs:
                continue
            current["experts"] = plan.experts_per_layer(pid)
            for ids in docs:
                model(input_ids=torch.from_numpy(ids[:max_tokens].astype("int64")).unsqueeze(0))
            used[pid] = len(docs)
    finally:
        for h in handles:
            h.remove()
    if not used:
        raise ConfigurationError(f"--router-data {dataset!r} has no documents for the composed paths: shard some first")
    return {layer: _rows(routers[layer].weight.detach(), sums[layer], counts[layer]) for layer in layers}, used


def _documents(run: Run, dataset: str) -> dict[str, Any]:
    from sharding.dataset import dataset_manifest

    manifest = dataset_manifest(run, dataset)
    if manifest.get("data_kind") != "documents":
        raise ConfigurationError(f"--router-data {dataset!r} holds prompts: give a documents dataset")
    return manifest


def _rows(weight: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor, generalist: bool = False) -> torch.Tensor:
    """Router rows: expert e's mean input, normalised to the layer's mean row norm, where e saw
    data. `generalist`: an expert no data reached (FlexOlmo's public expert) gets the mean of those
    directions, so it is every domain's runner-up rather than a random one."""
    w = weight.double().clone()  # (E, H)
    scale = w.norm(dim=1).mean()
    seen = [e for e in range(w.shape[0]) if counts[e] > 0]
    for e in seen:
        mean = sums[e] / counts[e]
        w[e] = mean / mean.norm().clamp_min(1e-12) * scale
    if generalist and seen:
        centre = torch.stack([w[e] for e in seen]).mean(0)
        for e in range(w.shape[0]):
            if counts[e] == 0:
                w[e] = centre / centre.norm().clamp_min(1e-12) * scale
    return w.float()


def base_router_rows(run: Run, family: Family, plan: Plan) -> dict[int, torch.Tensor]:
    """{layer: the base's router weight (E, H)}, read by ranged reads."""
    from paths.base import base_tensors
    from paths.models import load_tensor

    names = {fill(family.router[layout], layer): layer for layer in plan.sparse_layers for layout in ("disk", "memory")}
    out = {names[n]: load_tensor(run, e).float().clone() for n, e in base_tensors(run)[0].items() if n in names}
    if len(out) != len(plan.sparse_layers):
        raise ConfigurationError(f"the base of {run.url} has routers for {len(out)} of {len(plan.sparse_layers)} layers: it does not match the {family.name} family")
    return out


@torch.no_grad()
def domain_embed_rows(run: Run, family: Family, plan: Plan, paths: list[str], dataset: str, base_rows: dict[int, torch.Tensor], max_docs: int = 64, max_tokens: int = 256) -> tuple[dict[int, torch.Tensor], dict[str, int]]:
    """FlexOlmo's router: row e of layer l is the mean hidden state entering layer l's MLP in the
    trained model of each path choosing e, over a sample of that path's documents."""
    import tempfile

    from transformers.utils import logging as hf_logging

    from paths.models import load_model
    from sharding.dataset import read_documents

    hf_logging.disable_progress_bar()
    manifest = _documents(run, dataset)
    E, layers = plan.num_experts, plan.sparse_layers
    sums = {layer: torch.zeros(E, base_rows[layer].shape[1], dtype=torch.float64) for layer in layers}
    counts = {layer: torch.zeros(E, dtype=torch.float64) for layer in layers}
    used = {}
    for pid in sorted(paths):
        if pid not in manifest["paths"]:
            continue
        docs = read_documents(run, dataset, pid)[:max_docs]
        if not docs:
            continue
        experts = plan.experts_per_layer(pid)
        with tempfile.TemporaryDirectory(prefix=f"paths-embed-{pid}-") as local:
            model, _, _ = load_model(run, f"path:{pid}", local, kinds=("path",))

        def hook(layer: int):
            def capture(module: torch.nn.Module, args: Any):
                h = args[0].reshape(-1, args[0].shape[-1]).double()  # (T, H): the tokens entering the MLP
                sums[layer][experts[layer]] += h.sum(0)
                counts[layer][experts[layer]] += h.shape[0]

            return capture

        mlps = [model.get_submodule(family.mlp_module(layer)) for layer in layers]
        handles = [m.register_forward_pre_hook(hook(layer)) for layer, m in zip(layers, mlps)]
        try:
            for ids in docs:
                model(input_ids=torch.from_numpy(ids[:max_tokens].astype("int64")).unsqueeze(0))
        finally:
            for h in handles:
                h.remove()
        used[pid] = len(docs)
    if not used:
        raise ConfigurationError(f"--router-data {dataset!r} has no documents for the composed paths ({', '.join(sorted(paths))}): shard their data first")
    return {layer: _rows(base_rows[layer], sums[layer], counts[layer], generalist=True) for layer in layers}, used


def patch_tensor(path: str, name: str, value: torch.Tensor) -> None:
    """Overwrite one tensor of a local safetensors file in place (same dtype and shape)."""
    import json
    import struct

    from paths.models import DTYPES

    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        info = header[name]
        dtype = DTYPES[info["dtype"]]
        data = value.to(dtype).contiguous().view(torch.uint8).numpy().tobytes()
        begin, end = info["data_offsets"]
        if len(data) != end - begin or list(value.shape) != info["shape"]:
            raise ConfigurationError(f"router {name}: computed shape {list(value.shape)} does not fit {info['shape']}")
        f.seek(8 + n + begin)
        f.write(data)


def apply_centroids(run: Run, folder: str, family: Family, plan: Plan, dataset: str, weight_files: list[str], paths: list[str] | None = None, keep: list[list[int]] | None = None) -> dict[str, int]:
    """Compute the centroid routers from the composed model in `folder` and write them into its
    safetensors files; returns documents used per path."""
    from safetensors import safe_open

    rows, used = centroid_rows(run, folder, family, plan, dataset, paths=paths, keep=keep)
    names = {fill(family.router[layout], layer): layer for layer in rows for layout in ("disk", "memory")}
    for fname in weight_files:
        path = os.path.join(folder, fname)
        with safe_open(path, framework="pt") as f:
            present = [n for n in f.keys() if n in names]
        for name in present:
            patch_tensor(path, name, rows[names[name]])
    return used
