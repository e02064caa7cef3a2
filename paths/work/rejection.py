"""`paths rejection-sample`: DeepSeek-R1's stage 3 in miniature. Sample N completions per prompt
from a trained model, keep those the verifiers accept, and write them as prompt / completion records
that `paths shard --kind prompts --answer-field completion` turns into an sft dataset.

Kept per prompt: up to `keep` distinct completions whose weighted reward reaches `min_reward`.
Each output record carries the prompt record's fields, the gold answer as `gold`, the completion
and its reward; the file is written whole (temp + rename, or one PUT).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from paths.errors import ConfigurationError
from paths.models import load_model, parse_model
from paths.work.episodes import dataset_rewards
from paths.work.rewards import score
from paths.work.sampling import check_prompts, complete, record_fields
from paths.work.tasks import write_jsonl
from storage.layout import Run


def rejection_sample(run: Run, model_spec: str, dataset: str, out: str, *, shard: str | None = None, split: str = "train", n: int = 8, keep: int = 1,
                     rewards: list[str] | None = None, min_reward: float = 1.0, max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0,
                     limit: int | None = None, batch: int = 64, seed: int = 0, show_progress: bool = True) -> dict[str, Any]:
    """Sample, verify, keep, write; returns counts (prompts, sampled, kept, prompts with a kept one)."""
    from tqdm import tqdm

    from sharding.dataset import read_prompts

    if n < 1 or keep < 1 or max_new_tokens < 1 or temperature < 0:
        raise ConfigurationError(f"--n, --keep and --max-new-tokens must be >= 1 and --temperature >= 0, got {n}, {keep}, {max_new_tokens}, {temperature}")
    ref = parse_model(model_spec)
    shard = shard or (ref.name if ref.kind == "path" else None)
    if shard is None:
        raise ConfigurationError(f"--model {model_spec}: say which path shard's prompts to sample with --shard ID")
    fns = dataset_rewards(run, dataset, list(rewards or []))  # default: the dataset's environments, else math_answer
    records = read_prompts(run, dataset, shard, split)[:limit]
    if not records:
        raise ConfigurationError(f"dataset {dataset!r} has no {split} prompts for path {shard}: pick another --shard or --split")
    torch.manual_seed(seed)
    kept: list[dict[str, Any]] = []
    solved = sampled = 0
    with tempfile.TemporaryDirectory() as scratch, torch.no_grad():
        model, tokenizer, _ = load_model(run, model_spec, scratch)
        check_prompts(records, fns, dataset, getattr(model.config, "max_position_embeddings", None), max_new_tokens)
        per_chunk = max(1, batch // n)
        for i in tqdm(range(0, len(records), per_chunk), desc=f"rejection-sample {shard}", unit="chunk", disable=not show_progress or None):
            chunk = records[i : i + per_chunk]
            ids, _ = complete(model, chunk, n, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, chunk=batch)
            texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
            values, _ = score(fns, [r["prompt"] for r in chunk for _ in range(n)], texts, ids, record_fields(chunk, n))
            sampled += len(texts)
            for j, record in enumerate(chunk):
                chosen: list[tuple[str, float]] = []
                for text, value in zip(texts[j * n : (j + 1) * n], values[j * n : (j + 1) * n]):
                    if value >= min_reward and text not in (c for c, _ in chosen) and len(chosen) < keep:
                        chosen.append((text, value))
                solved += bool(chosen)
                base = {k: v for k, v in record.items() if k not in ("ids", "answer")}
                for k, (text, value) in enumerate(chosen):
                    kept.append({**base, "id": f"{record.get('id', f'{shard}-{i + j}')}-{k}", "gold": record["answer"], "completion": text, "reward": value})
    if not kept:
        raise ConfigurationError(f"no completion of {sampled} from {model_spec} reached reward {min_reward} on {len(records)} prompts: raise --n, lower --min-reward, or train the model first")
    write_jsonl(kept, out)
    return {"model": model_spec, "dataset": dataset, "shard": shard, "split": split, "prompts": len(records), "sampled": sampled, "kept": len(kept), "prompts_solved": solved, "out": out}
