"""Prompt / completion records of one path for `paths train --mode sft`.

Records come from a dataset sharded with `--kind prompts` (prompt in `--text-field`, completion in
`--answer-field`). A sample is prompt + completion + EOS, cut to seq_len + 1 tokens and padded;
`loss_from` is where the completion starts, so the loss covers completion tokens only. Order,
rank / worker split and resume are PathDataset's, with one record per block.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from paths.errors import ConfigurationError
from paths.work.mixture import Mixture
from sharding.dataset import PathDataset, read_prompts
from storage.layout import Run


class SFTDataset(PathDataset):
    """Prompt + completion samples with the prompt masked out of the loss."""

    def __init__(self, run: Run, dataset: str, path_id: str, seq_len: int, tokenizer: Any, **kwargs: Any):
        kwargs.setdefault("prefetch", 1)
        super().__init__(run, dataset, path_id, seq_len, **kwargs)
        records = read_prompts(self.run, dataset, path_id, self.split)
        if not records:
            raise ConfigurationError(f"dataset {dataset!r} has no {self.split} records for path {path_id}: shard more prompts or pick another path")
        answers = tokenizer([r["answer"] for r in records], add_special_tokens=False)["input_ids"]
        self.samples = [(r["ids"] + a + [tokenizer.eos_token_id], len(r["ids"])) for r, a in zip(records, answers)]
        self.num_windows = len(self.samples)
        self.block = 1

    def _read_block(self, block: int) -> np.ndarray:
        return np.zeros(0)  # records are in memory

    def window(self, block_tokens: np.ndarray, block: int, w: int) -> dict[str, torch.Tensor]:
        ids, prompt_len = self.samples[w]
        ids = ids[: self.seq_len + 1]
        tokens = torch.full((self.seq_len + 1,), self.pad_id, dtype=torch.long)
        tokens[: len(ids)] = torch.tensor(ids, dtype=torch.long)
        return {"tokens": tokens, "valid": torch.tensor(len(ids)), "index": torch.tensor(w), "loss_from": torch.tensor(min(prompt_len, len(ids)))}


class PromptDataset(PathDataset):
    """Prompt records of one path (for GRPO), yielding record indices in the shuffled order."""

    def __init__(self, run: Run, dataset: str, path_id: str, seq_len: int, mixture: str = "", **kwargs: Any):
        kwargs.setdefault("prefetch", 1)
        super().__init__(run, dataset, path_id, seq_len, **kwargs)
        self.records = read_prompts(self.run, dataset, path_id, self.split)
        if not self.records:
            raise ConfigurationError(f"dataset {dataset!r} has no {self.split} prompts for path {path_id}: shard more prompts or pick another path")
        self.num_windows = len(self.records)
        self.block = 1
        self.mixture = Mixture(self.records, mixture, f"dataset {dataset!r} for path {path_id}") if mixture else None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Shuffled record indices; with a mixture, the sources in its ratio (mixture.py)."""
        if self.mixture is None or not self.shuffle:
            return super().epoch_order(epoch)
        return self.mixture.order(self.num_windows, np.random.Generator(np.random.PCG64([self.seed, epoch])))[self.rank :: self.world_size]

    def _read_block(self, block: int) -> np.ndarray:
        return np.zeros(0)

    def window(self, block_tokens: np.ndarray, block: int, w: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(w)}
