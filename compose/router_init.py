"""`paths compose --router centroid`: each layer's router rows from the routed data.

Row e of layer l's router becomes the mean hidden state entering that layer's MoE block over the
documents that were routed to expert e (the documents of every path whose choice at l's level is
e), normalised and scaled to the layer's mean row norm, so token-level routing agrees with where
each expert was trained. Experts that no document reached keep their row.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from paths.errors import ConfigurationError
from paths.families import fill
from storage.layout import Run


@torch.no_grad()
def centroid_rows(run: Run, folder: str, family, plan, dataset: str, max_docs: int = 64, max_tokens: int = 256) -> tuple[dict[int, torch.Tensor], dict[str, int]]:
    """{layer: router weight (E, H)} from the model in `folder`, and documents used per path."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from sharding.dataset import dataset_manifest, read_documents

    hf_logging.disable_progress_bar()
    manifest = dataset_manifest(run, dataset)
    if manifest.get("data_kind") != "documents":
        raise ConfigurationError(f"--router-data {dataset!r} holds prompts: give a documents dataset")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    layers = range(plan.num_layers)
    routers = [model.get_submodule(fill(family.router["memory"], layer).rsplit(".", 1)[0]) for layer in layers]
    E = plan.num_experts
    sums = {layer: torch.zeros(E, routers[layer].weight.shape[1], dtype=torch.float64) for layer in layers}
    counts = {layer: torch.zeros(E, dtype=torch.float64) for layer in layers}
    current: dict[str, Any] = {}

    def hook(layer: int):
        def capture(module, args, output):
            h = args[0].reshape(-1, args[0].shape[-1]).double()  # (T, H): the tokens entering the block
            e = current["experts"][layer]
            sums[layer][e] += h.sum(0)
            counts[layer][e] += h.shape[0]

        return capture

    handles = [r.register_forward_hook(hook(layer)) for layer, r in zip(layers, routers)]
    used = {}
    try:
        for pid in sorted(manifest["paths"]):
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
        raise ConfigurationError(f"--router-data {dataset!r} has no documents: shard some first")
    out = {}
    for layer, r in zip(layers, routers):
        w = r.weight.detach().double().clone()  # (E, H)
        scale = w.norm(dim=1).mean()
        for e in range(E):
            if counts[layer][e] > 0:
                mean = sums[layer][e] / counts[layer][e]
                w[e] = mean / mean.norm().clamp_min(1e-12) * scale
        out[layer] = w.float()
    return out, used


def patch_tensor(path: str, name: str, value: torch.Tensor) -> None:
    """Overwrite one tensor of a local safetensors file in place (same dtype and shape)."""
    import json
    import struct

    from compose.merge import DTYPES

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


def apply_centroids(run: Run, folder: str, family, plan, dataset: str, weight_files: list[str]) -> dict[str, int]:
    """Compute the centroid routers from the composed model in `folder` and write them into its
    safetensors files; returns documents used per path."""
    from safetensors import safe_open

    rows, used = centroid_rows(run, folder, family, plan, dataset)
    names = {fill(family.router[layout], layer): layer for layer in rows for layout in ("disk", "memory")}
    for fname in weight_files:
        path = os.path.join(folder, fname)
        with safe_open(path, framework="pt") as f:
            present = [n for n in f.keys() if n in names]
        for name in present:
            patch_tensor(path, name, rows[names[name]])
    return used
