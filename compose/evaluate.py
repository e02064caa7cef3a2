"""`paths eval`: perplexity per path shard for any mix of models; reward accuracy on prompts.

Models: `base` (the run's MoE), `path:ID` / `expert:NAME` (a trained final/), `composed:NAME` (an
MoE, or an ensemble: loaded with its shipped modeling file), `hf:DIR`.
For a documents dataset every model is scored on every path's shard (held-out split by default):
token-level perplexity over non-overlapping windows of seq_len + 1 tokens, per shard and overall
(token-weighted). For a prompts dataset: the share of greedy completions that `math_answer`
accepts. The table is printed and the JSON written to eval/<dataset>/<time>.json in the run.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from typing import Any

import numpy as np
import torch

from paths.errors import ConfigurationError, NotFound
from paths.models import load_model
from storage.layout import Run
from storage.manifest import read_verified


@torch.no_grad()
def perplexity(model: torch.nn.Module, tokens: np.ndarray, seq_len: int, batch: int = 8) -> tuple[float, int]:
    """(summed negative log-likelihood, number of predicted tokens) over windows of the stream."""
    starts = list(range(0, max(0, len(tokens) - 1), seq_len))
    nll, count = 0.0, 0
    for i in range(0, len(starts), batch):
        rows = [torch.from_numpy(tokens[s : s + seq_len + 1].astype(np.int64)) for s in starts[i : i + batch]]
        width = max(len(r) for r in rows)
        x = torch.zeros(len(rows), width, dtype=torch.long)
        y = torch.full((len(rows), width - 1), -100, dtype=torch.long)
        for j, r in enumerate(rows):
            x[j, : len(r)] = r
            y[j, : len(r) - 1] = r[1:]
        logits = model(input_ids=x[:, :-1]).logits.float()  # (B, L, V)
        nll += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100, reduction="sum"))
        count += int((y != -100).sum())
    return nll, count


def evaluate(run: Run, dataset: str, models: list[str], *, split: str = "heldout", seq_len: int = 256, max_tokens: int = 50_000) -> dict[str, Any]:
    """Scores of every model on every path shard of the dataset; also written to the run."""
    from paths.work.sampling import evaluate as reward_eval
    from paths.work.rewards import load_reward
    from sharding.dataset import dataset_manifest, read_prompts, read_tokens

    manifest = dataset_manifest(run, dataset)
    prompts = manifest.get("data_kind") == "prompts"
    shards = [p for p, c in sorted(manifest["paths"].items()) if c[f"{split}_docs"] > 0]
    if not shards:
        raise ConfigurationError(f"dataset {dataset!r} has no {split} documents: shard it with --holdout > 0, or use --split train")
    data = {p: (read_prompts(run, dataset, p, split) if prompts else read_tokens(run, dataset, p, split, max_tokens)) for p in shards}
    metric = "math_answer accuracy" if prompts else "perplexity"
    table: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for spec in models:
            model, tokenizer, _ = load_model(run, spec, scratch)
            row, total_nll, total_n = {}, 0.0, 0
            for p in shards:
                if prompts:
                    row[p] = reward_eval(model, tokenizer, data[p], [load_reward("math_answer")], max_new_tokens=32)["reward"]
                else:
                    nll, n = perplexity(model, data[p], seq_len)
                    row[p] = math.exp(nll / max(1, n))
                    total_nll, total_n = total_nll + nll, total_n + n
            row["overall"] = math.exp(total_nll / max(1, total_n)) if not prompts else sum(row.values()) / len(row)
            table[spec] = row
            del model
    labels = _domain_labels(run, manifest, shards)
    result = {"dataset": dataset, "split": split, "metric": metric, "seq_len": seq_len, "max_tokens": max_tokens, "shards": shards, "labels": labels, "table": table, "at": time.time()}
    run.store.write(f"eval/{dataset}/{int(result['at'])}.json", json.dumps(result, indent=2).encode())
    return result


def _domain_labels(run: Run, manifest: dict[str, Any], shards: list[str]) -> dict[str, str]:
    """{shard: "domain:shard"} for a dataset routed by domain onto paths (what each column is)."""
    router = manifest.get("router") or {}
    if router.get("kind") != "domain" or not router.get("name"):
        return {}
    try:
        body = json.loads(read_verified(run.store, run.router(router["name"]), "router.json"))
    except NotFound:
        return {}
    domains = (body.get("options") or {}).get("domain_map") or {}
    return {p: f"{d}:{p}" for d, p in sorted(domains.items()) if p in shards and d != p}
