"""Next-token steps and the batches they read, for `Trainer` (paths/trainer.py).

- `LMStep`: lm and sft. `grad_accum` micro-batches; the summed loss of each is divided by the
  step's target count, so 4 micro-batches of 1 equal 1 of 4. sft counts completion tokens only.
- `ShardBatches`: one path shard's windows (a `PathDataset`), counting what it handed out.
- `RoundRobin`: batches from several shards in turn (the MoE fine-tune's mixed data).
"""

from __future__ import annotations

from typing import Any

import torch

from paths.errors import ConfigurationError
from paths.head_loss import fusable, head_loss
from paths.train_config import TrainConfig


def target_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, L) the targets that count: real tokens, and for sft only completion tokens."""
    pos = torch.arange(batch["tokens"].shape[1] - 1).unsqueeze(0)  # (1, L)
    keep = pos < (batch["valid"].unsqueeze(1) - 1)
    if "loss_from" in batch:
        keep &= pos >= (batch["loss_from"].unsqueeze(1) - 1)
    return keep


def targets_of(batch: dict[str, torch.Tensor]) -> int:
    """Targets of a batch that count in the loss."""
    return int(target_mask(batch).sum())


def micro_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], total_targets: int) -> torch.Tensor:
    """Summed next-token loss over the batch's real targets, divided by the step's target count."""
    tokens = batch["tokens"]  # (B, L+1)
    x, y = tokens[:, :-1], tokens[:, 1:].clone()  # (B, L)
    y[~target_mask(batch)] = -100
    x = x.to(next(model.parameters()).device)
    if fusable(model):  # the head a chunk of rows at a time, logits never whole (paths/head_loss.py)
        return head_loss(model, x, y, 1.0 / max(1, total_targets))
    logits = model(input_ids=x).logits  # (B, L, V)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1).to(logits.device), ignore_index=-100, reduction="sum")
    return loss / max(1, total_targets)


class LMStep:
    """The lm / sft step: grad_accum micro-batches, loss normalised by the step's targets."""

    checkpoint_multiple = 1

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    def __call__(self, model: torch.nn.Module, acc: Any, batches: Any) -> dict[str, float]:
        micro = [next(batches) for _ in range(self.cfg.grad_accum)]
        total = sum(targets_of(b) for b in micro)
        loss_sum = 0.0
        for b in micro:
            loss = self.micro_step(model, acc, b, total)
            loss_sum += loss
        return {"loss": loss_sum, "tokens": total, **self.extra()}

    def micro_step(self, model: torch.nn.Module, acc: Any, batch: dict[str, torch.Tensor], total: int) -> float:
        """Backward of one micro-batch; its share of the step's loss."""
        loss = micro_loss(model, batch, total)
        acc.backward(loss)
        return float(loss.detach())

    def extra(self) -> dict[str, float]:
        """More metrics of the step just taken (a subclass's auxiliary losses)."""
        return {}


class ShardBatches:
    """Batches of one shard's dataset; counts the samples handed out, the position to save.

    The loader gets its own generator: creating its iterator must not draw from the global RNG,
    which samplers use and checkpoints save (resume is exact only that way).
    """

    def __init__(self, dataset: Any, batch_size: int, seed: int, num_workers: int = 0):
        self.dataset, self.batch_size, self.seed, self.num_workers = dataset, batch_size, seed, num_workers
        self.consumed = dataset.position
        self._it: Any = None

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._it is None:
            loader = torch.utils.data.DataLoader(self.dataset, batch_size=self.batch_size, num_workers=self.num_workers, generator=torch.Generator().manual_seed(self.seed))
            self._it = iter(loader)
        batch = next(self._it)
        self.consumed += len(batch["index"])
        return batch

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict(position=self.consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
        self.consumed = self.dataset.position
        self._it = None


class RoundRobin:
    """Batches from each shard in turn; its state is the turn and every shard's position."""

    def __init__(self, shards: dict[str, ShardBatches]):
        self.shards = shards
        self.ids = sorted(shards)
        self.turn = 0

    def __next__(self) -> dict[str, torch.Tensor]:
        pid = self.ids[self.turn % len(self.ids)]
        self.turn += 1
        return next(self.shards[pid])

    def state_dict(self) -> dict[str, Any]:
        return {"turn": self.turn, "shards": {p: s.state_dict() for p, s in self.shards.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if sorted(state["shards"]) != self.ids:
            raise ConfigurationError(f"the checkpoint mixes shards {sorted(state['shards'])}, this dataset has {self.ids}: resume with the same dataset")
        self.turn = state["turn"]
        for p, s in state["shards"].items():
            self.shards[p].load_state_dict(s)
