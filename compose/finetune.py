"""`paths finetune-moe`: Branch-Train-MiX's last stage. A composed MoE learns token-level routing
(and, with `train="all"`, everything) on data mixed from every path's shard, with a Switch
load-balancing loss; the result is a new composed/<out>/ checkpoint that stock transformers loads.

It runs through the same `Trainer` as `paths train` (paths/trainer.py): checkpoints under
work/moe-<out>/ with exact resume (weights, optimizer, every shard's data position, RNG, metrics),
metrics in work/moe-<out>/metrics.jsonl, time-based checkpoints, and SIGTERM / SIGINT commit a
checkpoint and exit 143. Each optimizer step takes `grad_accum` micro-batches, one path's shard
after another in turn (`RoundRobin`), so every step sees the paths' data mixed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Literal

import torch

from paths.adapters import attach, merged_state, spec_of, target_modules
from paths.checkpoint import check_resumable, start_digest
from paths.errors import ConfigurationError
from paths.steps import LMStep, RoundRobin, ShardBatches, micro_loss
from paths.tracking import accelerator
from paths.train_config import TrainConfig
from storage.layout import Run
from storage.manifest import install

if TYPE_CHECKING:
    from typing import Callable


class MoEStep(LMStep):
    """The lm step plus the Switch load-balancing loss of the patched MoE blocks (`found`)."""

    def __init__(self, cfg: TrainConfig, found: list[Any], aux_weight: float):
        super().__init__(cfg)
        self.found, self.aux_weight = found, aux_weight
        self.aux = 0.0

    def __call__(self, model: torch.nn.Module, acc: Any, batches: Any) -> dict[str, float]:
        self.aux = 0.0
        return super().__call__(model, acc, batches)

    def micro_step(self, model: torch.nn.Module, acc: Any, batch: dict[str, torch.Tensor], total: int) -> float:
        from experts.moe import load_balancing_loss

        loss = micro_loss(model, batch, total)
        balance = load_balancing_loss(self.found)
        acc.backward(loss + self.aux_weight * balance / self.cfg.grad_accum)
        self.aux += float(balance.detach()) / self.cfg.grad_accum
        return float(loss.detach())

    def extra(self) -> dict[str, float]:
        return {"aux_loss": self.aux}


def finetune_moe(
    run: Run,
    source: str,
    dataset: str,
    out: str,
    cfg: TrainConfig,
    *,
    train: Literal["router", "all"] = "router",
    aux_loss: float = 0.01,
    backend: str = "auto",
    overwrite: bool = False,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Fine-tune composed:<source> into composed/<out>/; returns the summary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from experts.moe import patched, resolve_backend
    from paths.families import family_of_config, fill
    from paths.models import resolve_model
    from paths.trainer import Signals, Trainer
    from sharding.dataset import PathDataset, dataset_manifest

    hf_logging.disable_progress_bar()
    if train not in ("router", "all"):
        raise ConfigurationError(f"--train must be router or all, got {train!r}")
    if aux_loss < 0:
        raise ConfigurationError(f"--aux-loss must be >= 0, got {aux_loss}")
    prefix = run.composed(out)
    if run.store.exists(f"{prefix}/manifest.json") and not overwrite:
        raise ConfigurationError(f"{run.store.url_of(prefix)} already exists: pass --overwrite or choose another --out")
    scratch = run.store.scratch_dir("finetune")
    try:
        folder = resolve_model(run, f"composed:{source}", scratch, kinds=("composed",)).folder
        with open(os.path.join(folder, "config.json")) as f:
            family = family_of_config(json.load(f), f"composed:{source}")  # an ensemble is refused here: it has no routers
        manifest = dataset_manifest(run, dataset)
        if manifest.get("data_kind") != "documents":
            raise ConfigurationError(f"finetune-moe needs a documents dataset; {dataset!r} holds prompts")
        shards = sorted(p for p, c in manifest["paths"].items() if c["train_tokens"] > cfg.seq_len)
        if not shards:
            raise ConfigurationError(f"dataset {dataset!r} has no shard with more than {cfg.seq_len} training tokens")
        chosen = resolve_backend(backend)

        if cfg.fsdp:
            raise ConfigurationError("finetune-moe runs the composed MoE whole on each process: drop --fsdp (fsdp = true)")
        lora = spec_of(cfg)
        if lora is not None and (train == "all" or lora.base != "fp32"):
            raise ConfigurationError("finetune-moe --lora trains an adapter (fp32 base) and the routers in full: drop --train all and --quantize-base, or drop --lora")
        if lora is not None and not lora.targets:
            lora = dataclasses.replace(lora, targets=("attention",))
        acc = accelerator(cfg.precision, cfg.report_to, cfg.logging_dir)
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        routers = {fill(t, layer) for layer in family.sparse_layers(model.config) for t in (family.router["memory"], *family.router_extras)}  # a router bias trains with its router
        for name, p in model.named_parameters():
            p.requires_grad_(train == "all" or name in routers)
        batches = RoundRobin({p: ShardBatches(PathDataset(run, dataset, p, cfg.seq_len, seed=cfg.seed, batch_size=cfg.batch_size), cfg.batch_size, cfg.seed) for p in shards})
        job = {"mode": "finetune-moe", "dataset": dataset, "source": source, "train": train, "lora": lora.to_json() if lora else None, "start": start_digest(folder) if lora else None}
        check_resumable(run, f"moe-{out}", job)
        with patched(model, family, chosen) as found:
            if lora:  # the adapter beside the targets (attention by default: the experts are fused tensors), the routers in full beside it
                model = attach(model, lora, target_modules(model, lora, [], False, f"composed:{source}"))
                for name, p in model.named_parameters():
                    p.requires_grad_(p.requires_grad or name.removeprefix("base_model.model.") in routers)
            trainer = Trainer(
                run, f"moe-{out}", job, cfg, model, MoEStep(cfg, found, aux_loss), batches, acc,
                callbacks=[Signals()], desc="finetune-moe", show_progress=show_progress, resume_hint="run the same `paths finetune-moe` command again",
            )
            result = trainer.fit()
        summary = {
            "name": out, "into": "moe", "finetuned_from": source, "dataset": dataset, "train": train, "aux_loss": aux_loss, "backend": chosen,
            "steps": result.step, "resumed_from": result.resumed_from, "tokens": result.tokens, "final_loss": result.loss, "shards": shards, "config": cfg.to_json(), "at": time.time(),
            **({"lora": lora.to_json()} if lora else {}),
        }

        def commit(fence: Callable[[], None]) -> None:
            staged = os.path.join(scratch, "out")
            if lora is not None:  # the adapter merged into the weights: stock transformers loads the result
                merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
                merged.load_state_dict(merged_state(trainer.unwrapped, lora))
                merged.save_pretrained(staged)
            else:
                trainer.unwrapped.save_pretrained(staged)
            AutoTokenizer.from_pretrained(folder).save_pretrained(staged)
            fence()
            install(run.store, staged, prefix, overwrite, {"compose.json": summary}, kind="composed", into="moe", name=out, finetuned_from=source)

        trainer.finish(commit)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return summary
