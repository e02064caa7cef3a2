"""`paths finetune-moe`: Branch-Train-MiX's last stage. A composed MoE learns token-level routing
(and, with `train="all"`, everything) on data mixed from every path's shard, with a Switch
load-balancing loss; checkpoints and exact resume as in `paths train` (under work/moe-<out>/);
the result is a new composed/<out>/ checkpoint that stock transformers loads.

Each optimizer step takes `grad_accum` micro-batches, one path's shard after another in turn, so
every step sees the paths' data mixed; the data position of every shard is checkpointed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any, Literal

import torch

from paths.errors import ConfigurationError, NotFound
from paths.train_config import TrainConfig
from storage.layout import Run
from storage.manifest import ArtifactWriter


class Mixed:
    """Batches from each shard in turn; its state is the turn and every shard's position."""

    def __init__(self, datasets: dict[str, Any], batch_size: int, seed: int):
        self.datasets = datasets
        self.ids = sorted(datasets)
        self.batch_size, self.seed = batch_size, seed
        self.turn = 0
        self._its: dict[str, Any] = {}
        self.consumed = {p: d.position for p, d in datasets.items()}

    def _iter(self, pid: str):
        if pid not in self._its:
            loader = torch.utils.data.DataLoader(self.datasets[pid], batch_size=self.batch_size, num_workers=0, generator=torch.Generator().manual_seed(self.seed))
            self._its[pid] = iter(loader)
        return self._its[pid]

    def __next__(self) -> dict[str, torch.Tensor]:
        pid = self.ids[self.turn % len(self.ids)]
        self.turn += 1
        batch = next(self._iter(pid))
        self.consumed[pid] += len(batch["index"])
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"turn": self.turn, "shards": {p: d.state_dict(position=self.consumed[p]) for p, d in self.datasets.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if sorted(state["shards"]) != self.ids:
            raise ConfigurationError(f"the checkpoint mixes shards {sorted(state['shards'])}, this dataset has {self.ids}: resume with the same dataset")
        self.turn = state["turn"]
        for p, s in state["shards"].items():
            self.datasets[p].load_state_dict(s)
            self.consumed[p] = s["position"]
        self._its.clear()


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

    from experts.moe import load_balancing_loss, patched, resolve_backend
    from paths import checkpoint
    from paths.base import fetch_dir
    from paths.families import family_of_config, fill
    from paths.train import _rng_state, _set_rng_state, lr_factor, make_optimizer, micro_loss, targets_of
    from sharding.dataset import PathDataset, dataset_manifest

    hf_logging.disable_progress_bar()
    if train not in ("router", "all"):
        raise ConfigurationError(f"--train must be router or all, got {train!r}")
    if aux_loss < 0:
        raise ConfigurationError(f"--aux-loss must be >= 0, got {aux_loss}")
    prefix = run.composed(out)
    if run.store.exists(f"{prefix}/manifest.json") and not overwrite:
        raise ConfigurationError(f"{run.store.url_of(prefix)} already exists: pass --overwrite or choose another --out")
    try:
        folder = fetch_dir(run, run.composed(source))
    except NotFound:
        raise NotFound(f"no composed model {source!r} in {run.url}: run `paths compose {run.url} --name {source}` first") from None
    config = json.load(open(os.path.join(folder, "config.json")))
    family = family_of_config(config, f"composed:{source}")  # an ensemble is refused here: it has no routers
    manifest = dataset_manifest(run, dataset)
    if manifest.get("data_kind") != "documents":
        raise ConfigurationError(f"finetune-moe needs a documents dataset; {dataset!r} holds prompts")
    shards = sorted(p for p, c in manifest["paths"].items() if c["train_tokens"] > cfg.seq_len)
    if not shards:
        raise ConfigurationError(f"dataset {dataset!r} has no shard with more than {cfg.seq_len} training tokens")
    chosen = resolve_backend(backend)
    unit = f"moe-{out}"

    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    routers = {fill(family.router["memory"], layer) for layer in range(model.config.num_hidden_layers)}
    for name, p in model.named_parameters():
        p.requires_grad_(train == "all" or name in routers)
    optimizer = make_optimizer(model, cfg)
    data = Mixed({p: PathDataset(run, dataset, p, cfg.seq_len, seed=cfg.seed, batch_size=cfg.batch_size) for p in shards}, cfg.batch_size, cfg.seed)
    job = {"mode": "finetune-moe", "dataset": dataset, "source": source, "train": train}
    start, tokens, metrics = 0, 0, []
    resumed = checkpoint.load_latest(run, unit, job)
    if resumed is not None:
        start, model_sd, opt_sd, state = resumed
        model.load_state_dict(model_sd)
        checkpoint.load_optimizer(optimizer, opt_sd, state["optimizer"])
        data.load_state_dict(state["data"])
        _set_rng_state(state["rng"])
        tokens = state["tokens"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg), last_epoch=start - 1) if start else torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))

    def save(step: int, loss: float) -> None:
        state = {**job, "step": step, "tokens": tokens, "loss": loss, "config": cfg.to_json(), "data": data.state_dict(), "rng": _rng_state()}
        checkpoint.save(run, unit, step, model, optimizer, state, lambda: None)
        checkpoint.prune(run, unit, cfg.keep_checkpoints)

    from tqdm import tqdm

    bar = tqdm(total=cfg.steps, initial=start, desc=f"finetune-moe {out}", disable=not show_progress, leave=False)
    model.train()
    t0, loss_value = time.time(), float("nan")
    with patched(model, family, chosen) as found:
        for step in range(start + 1, cfg.steps + 1):
            batches = [{k: v.to(device) for k, v in next(data).items()} for _ in range(cfg.grad_accum)]
            total = sum(targets_of(b) for b in batches)
            lm, aux = 0.0, 0.0
            for b in batches:
                loss, _ = micro_loss(model, b, total)
                balance = load_balancing_loss(found)
                (loss + aux_loss * balance / cfg.grad_accum).backward()
                lm += float(loss.detach())
                aux += float(balance.detach()) / cfg.grad_accum
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            tokens += total
            loss_value = lm
            metrics.append({"step": step, "loss": lm, "aux_loss": aux, "lr": scheduler.get_last_lr()[0], "tokens": tokens, "tokens_per_s": tokens / max(1e-9, time.time() - t0), "time": time.time()})
            bar.update(1)
            bar.set_postfix(loss=f"{lm:.3f}", aux=f"{aux:.3f}")
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps:
                save(step, lm)
    bar.close()
    run.store.write(f"{run.work(unit)}/metrics.jsonl", "".join(json.dumps(m) + "\n" for m in metrics).encode())

    model.to("cpu")
    tmp = tempfile.mkdtemp(prefix="paths-finetune-")
    try:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(folder).save_pretrained(tmp)
        summary = {
            "name": out, "into": "moe", "finetuned_from": source, "dataset": dataset, "train": train, "aux_loss": aux_loss, "backend": chosen,
            "steps": cfg.steps, "resumed_from": start, "tokens": tokens, "final_loss": loss_value, "shards": shards, "config": cfg.to_json(), "at": time.time(),
        }
        if overwrite:
            run.store.delete_prefix(prefix)
        writer = ArtifactWriter(run.store, prefix)
        for fname in sorted(os.listdir(tmp)):
            writer.upload(fname, os.path.join(tmp, fname))
        writer.write_json("compose.json", summary)
        writer.commit(kind="composed", into="moe", name=out, finetuned_from=source)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summary
