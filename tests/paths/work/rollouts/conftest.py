"""Helpers of the asynchronous RL tests: settings, admitted worker keys, policy version 0, honest
workers, and forgeries written the way an attacker with an admitted key (or just write access to
the bucket) would write them."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from paths.train_config import load_config
from paths.work.grpo import logprobs_in_chunks, pack, score_samples
from paths.work.rewards import load_reward
from paths.work.rollouts import admit, batch_key, decode, encode, load_key, new_key, publish, rollout_worker
from tests.paths.work.conftest import FAST, loaded

STORE = ["rollouts=store", "max_async=10", "rollout_wait=0", "lr=1e-2"]
REWARD = "math_answer"
SALT = "00" * 32


def settings(*extra: str):
    return load_config(sets=[*FAST, *STORE, *extra], mode=None)


def keyed(run, tmp_path, name: str):
    """A new worker key, admitted to the run as `name`."""
    path = str(tmp_path / "keys" / f"{name}.key")
    admit(run, name, new_key(path))
    return load_key(path)


def start(run, tmp_path):
    """Policy version 0 of p00 (its starting weights), as the trainer publishes it."""
    model, _ = loaded(run, tmp_path)
    publish(run, "p00", 0, model, SALT, max_async=10, step=0)


def worker(run, n: int, key, cfg=None, name: str | None = None, dtype: str = "fp32"):
    return rollout_worker(run, "p00", "rl", cfg or settings(), [load_reward(REWARD)], worker=name, key=key, batches=n, wait=5, dtype=dtype)


def final(run, path: str = "p00") -> dict[str, torch.Tensor]:
    return load_file(run.store.path(f"work/{path}/final/model.safetensors"))


def rejections(run) -> dict[str, dict]:
    """Rejection records by batch key."""
    return {r["key"]: r for r in (json.loads(run.store.read(o.key)) for o in run.store.list("rollouts/p00/rejected"))}


def forge(run, tmp_path, key_name: str, key, index: int, change, cfg=None) -> str:
    """An attacker's batch: what its admitted key honestly draws for batch `index`, then changed by
    `change(meta, completions, model, tokenizer, records)`, its rewards and behaviour log-probs
    recomputed truthfully under policy version 0 (so only the seed check can tell), signed again
    with its own key. Written over the honest one; returns its key."""
    cfg = cfg or settings()
    k = batch_key(run, "p00", key_name, index)
    if not run.store.exists(k):
        worker(run, 1, key, cfg)
    batch = decode(run.store.read(k), k, 1 << 30)
    model, tokenizer = loaded(run, tmp_path)
    from sharding.dataset import read_prompts

    prompts = read_prompts(run, "rl", "p00")
    completions = [list(c) for c in batch.completion_ids]
    meta = dict(batch.meta)
    change(meta, completions, model, tokenizer, prompts)
    records = [prompts[i] for i in meta["prompt_index"]]
    meta["rewards"] = score_samples(records, completions, [c[-1] != tokenizer.eos_token_id for c in completions], [load_reward(REWARD)], cfg, tokenizer).rewards
    ids, attention, p, _ = pack(records, completions, cfg.group_size, tokenizer.pad_token_id, torch.device("cpu"))
    logp = logprobs_in_chunks(model, ids, attention, p, cfg.temperature, len(ids))
    run.store.write(k, encode(completions, logp, meta, key))
    return k
