"""Helpers of the GRPO tests: a run with arithmetic prompts, the settings of a fast step, a path's
starting model, and a unit's metrics."""

from __future__ import annotations

import json

import torch

from paths.work.tasks import arithmetic, write_jsonl
from sharding.shard import ShardOptions, shard
from tests.sharding.conftest import make_run

FAST = ["batch_size=4", "group_size=8", "max_new_tokens=4", "warmup_steps=1", "min_lr_ratio=1.0", "checkpoint_every=0"]


def prompt_run(tmp_path, tokenizer_dir, holdout: float, id_field: str | None = None):
    """A one-level run (4 experts) with 200 arithmetic prompts (levels 1 and 2) routed by hash."""
    run = make_run(str(tmp_path / "run"), tokenizer_dir, 1)
    f = str(tmp_path / "tasks.jsonl")
    write_jsonl(arithmetic(200, [1, 2]), f)
    shard(run, ShardOptions(dataset="rl", inputs=[f], kind="prompts", text_field="prompt", id_field=id_field, holdout=holdout))
    return run


def metrics(run, path: str) -> list[dict]:
    return [json.loads(x) for x in run.store.read(f"work/{path}/metrics.jsonl").decode().splitlines()]


def loaded(run, tmp_path, path: str = "p00"):
    """(model, tokenizer) of a path cut from the run's base, in float32, seeded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paths.models import materialize

    folder = str(tmp_path / f"{path}-init")
    materialize(run, path, folder)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder)
