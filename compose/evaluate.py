"""`paths eval`: perplexity per path shard for any mix of models; reward accuracy on prompts.

Models: `base` (the run's MoE), `path:ID` / `expert:NAME` (a trained final/), `composed:NAME` (an
MoE, or an ensemble: loaded with its shipped modeling file), `hf:DIR`.
For a documents dataset every model is scored on every path's shard (held-out split by default):
token-level perplexity over non-overlapping windows of seq_len + 1 tokens, per shard and overall
(token-weighted). For a prompts dataset: the mean reward of greedy completions (`math_answer`
accuracy by default; a dataset sharded from environments is scored by their own scorers, and a
multi-turn environment runs greedy episodes); per task (each environment, or each reasoning-gym
generator), the mean reward and, with `samples` k > 1, pass@k: the share of prompts where one of k
completions sampled at temperature 1 scores at least `pass_threshold`. The table is printed and
the JSON written to eval/<dataset>/<time>.json in the run.
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


def evaluate(run: Run, dataset: str, models: list[str], *, split: str = "heldout", seq_len: int = 256, max_tokens: int = 50_000, rewards: list[str] | None = None,
             samples: int = 1, max_new_tokens: int = 32, pass_threshold: float = 0.5) -> dict[str, Any]:
    """Scores of every model on every path shard of the dataset; also written to the run."""
    from sharding.dataset import dataset_manifest, read_prompts, read_tokens

    manifest = dataset_manifest(run, dataset)
    prompts = manifest.get("data_kind") == "prompts"
    shards = [p for p, c in sorted(manifest["paths"].items()) if c[f"{split}_docs"] > 0]
    if not shards:
        raise ConfigurationError(f"dataset {dataset!r} has no {split} documents: shard it with --holdout > 0, or use --split train")
    if samples < 1:
        raise ConfigurationError(f"--samples must be >= 1, got {samples}")
    data = {p: (read_prompts(run, dataset, p, split) if prompts else read_tokens(run, dataset, p, split, max_tokens)) for p in shards}
    scorer = PromptScorer(run, dataset, rewards or [], samples, max_new_tokens, pass_threshold) if prompts else None
    metric = scorer.metric if scorer else "perplexity"
    table: dict[str, dict[str, float]] = {}
    tasks: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for spec in models:
            model, tokenizer, _ = load_model(run, spec, scratch)
            row, total_nll, total_n = {}, 0.0, 0
            for p in shards:
                if scorer:
                    row[p] = scorer.score(model, tokenizer, data[p])
                else:
                    nll, n = perplexity(model, data[p], seq_len)
                    row[p] = math.exp(nll / max(1, n))
                    total_nll, total_n = total_nll + nll, total_n + n
            row["overall"] = math.exp(total_nll / max(1, total_n)) if not prompts else sum(row.values()) / len(row)
            table[spec] = row
            if scorer:
                tasks[spec] = scorer.tasks()
            del model
    labels = _domain_labels(run, manifest, shards)
    result = {"dataset": dataset, "split": split, "metric": metric, "seq_len": seq_len, "max_tokens": max_tokens, "shards": shards, "labels": labels, "table": table, "at": time.time()}
    if scorer and scorer.per_task:
        result.update(tasks=tasks, samples=samples, pass_threshold=pass_threshold)
    run.store.write(f"eval/{dataset}/{int(result['at'])}.json", json.dumps(result, indent=2).encode())
    return result


class PromptScorer:
    """Rewards of one model's completions of prompt records: the mean reward, and per task (and
    with k samples, pass@k)."""

    def __init__(self, run: Run, dataset: str, rewards: list[str], samples: int, max_new_tokens: int, threshold: float):
        from paths.envs.spec import check_versions
        from paths.work.rewards import load_reward, reward_specs
        from paths.work.episodes import episode_sampler
        from sharding.dataset import dataset_manifest

        environments = dataset_manifest(run, dataset).get("environments") or []
        check_versions(environments, f"dataset {dataset!r}")
        self.episodes = episode_sampler(run, dataset, environments)
        specs = reward_specs(rewards, environments, dataset, skip=self.episodes.spec.text if self.episodes else None)
        self.rewards = [load_reward(r) for r in specs]
        self.metric = "math_answer accuracy" if specs == ["math_answer"] and not self.episodes else "mean reward"
        self.per_task = bool(environments) or samples > 1
        self.k, self.max_new_tokens, self.threshold = samples, max_new_tokens, threshold
        self.seen: dict[str, list[tuple[float, bool]]] = {}

    def score(self, model: torch.nn.Module, tokenizer: Any, records: list[dict[str, Any]]) -> float:
        """The mean greedy reward of these records (their per-task scores are kept for `tasks`)."""
        greedy = self._rewards(model, tokenizer, records, 1, 0.0)
        passed = [any(v >= self.threshold for v in vs) for vs in _chunks(self._rewards(model, tokenizer, records, self.k, 1.0), self.k)] if self.k > 1 else [False] * len(records)
        for r, g, p in zip(records, greedy, passed):
            self.seen.setdefault(task_of(r), []).append((g, p))
        return sum(greedy) / max(1, len(greedy))

    def tasks(self) -> dict[str, dict[str, float]]:
        """{task: {"reward", "pass@k", "prompts"}} over the records scored since the last call."""
        out = {}
        for task, got in sorted(self.seen.items()):
            out[task] = {"reward": sum(g for g, _ in got) / len(got), "prompts": len(got), **({f"pass@{self.k}": sum(p for _, p in got) / len(got)} if self.k > 1 else {})}
        self.seen = {}
        return out

    def _rewards(self, model: torch.nn.Module, tokenizer: Any, records: list[dict[str, Any]], k: int, temperature: float) -> list[float]:
        from paths.work.rewards import score
        from paths.work.sampling import complete, record_fields

        if not records:
            return []
        if self.episodes is not None:
            return self.episodes.samples(model, records, self.rewards, tokenizer, group=k, budget=self.max_new_tokens, temperature=temperature, top_p=1.0, chunk=64).rewards
        ids, _ = complete(model, records, k, tokenizer, max_new_tokens=self.max_new_tokens, temperature=temperature, chunk=64)
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        total, _ = score(self.rewards, [r["prompt"] for r in records for _ in range(k)], texts, ids, record_fields(records, k))
        return total


def task_of(record: dict[str, Any]) -> str:
    """A prompt's task: its reasoning-gym generator, else its environment, else "all"."""
    info = record.get("info")
    source = (info.get("metadata") or {}).get("source_dataset") if isinstance(info, dict) and isinstance(info.get("metadata"), dict) else None
    return f"reasoning-gym:{source}" if source else record.get("env") or "all"


def _chunks(xs: list[float], k: int) -> list[list[float]]:
    return [xs[i : i + k] for i in range(0, len(xs), k)]


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
