"""Checkpoints of a path being trained: `work/<path>/ckpt-<step>/`.

    model.safetensors       the dense path's weights (a LoRA unit: its adapter only; the base is base/'s)
    optimizer.safetensors   AdamW moments and step counts, keyed "<param index>.<name>"
    state.json              step, tokens, loss, scheduler, data position, RNG, config, lease
    manifest.json           sha256 of the three files above
    COMMITTED               last, written only after the lease was renewed (fencing)

A checkpoint without COMMITTED, or whose files do not match its manifest, is skipped on resume for
the previous committed one (with a warning).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from typing import Any, Callable

import torch

from paths.errors import ConfigurationError, IntegrityError, NotFound, StorageError
from storage.layout import COMMITTED, Run
from storage.manifest import ArtifactWriter, read_manifest, read_verified


def unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied embeddings): copy the later ones."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        v = v.detach().cpu().contiguous()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out


def optimizer_tensors(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON-able rest) of an optimizer's (index-keyed) state dict."""
    tensors, scalars = {}, {}
    for index, state in sd["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> None:
    optimizer.load_state_dict(optimizer_state(tensors, rest))


def optimizer_state(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> dict[str, Any]:
    """The index-keyed optimizer state dict `optimizer_tensors` split."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    for key, value in rest["scalars"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": rest["param_groups"]}


def save(run: Run, path_id: str, step: int, weights: dict[str, torch.Tensor], optimizer: dict[str, Any], state: dict[str, Any], fence: Callable[[], None],
         files: dict[str, bytes] | None = None) -> dict[str, Any]:
    """Write a checkpoint (and `files`, e.g. the metrics so far, as part of it); `fence()` (a lease
    renewal) runs just before COMMITTED and raises LeaseLost when another worker holds the path,
    leaving the checkpoint uncommitted."""
    from safetensors.torch import save as st_save

    t0 = time.perf_counter()
    prefix = run.checkpoint(path_id, step)
    writer = ArtifactWriter(run.store, prefix)
    writer.write("model.safetensors", st_save(unshared(weights)))
    tensors, rest = optimizer_tensors(optimizer)  # its index-keyed state dict
    writer.write("optimizer.safetensors", st_save(tensors))
    writer.write_json("state.json", {**state, "optimizer": rest})
    for name, data in (files or {}).items():
        writer.write(name, data)
    writer.commit(kind="checkpoint", step=step)
    fence()
    run.store.write(f"{prefix}/{COMMITTED}", json.dumps({"step": step, "at": time.time()}).encode())
    size = sum(e["bytes"] for e in writer.files.values())
    return {"step": step, "bytes": size, "seconds": time.perf_counter() - t0}


def load_latest(run: Run, path_id: str, job: dict[str, Any] | None = None) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]] | None:
    """(step, model tensors, optimizer tensors, state) of the newest intact committed checkpoint
    (of this job: its state.json matches every `job` field, e.g. mode and dataset)."""
    from safetensors.torch import load

    for step, committed in reversed(run.checkpoints(path_id)):
        if not committed:
            continue
        prefix = run.checkpoint(path_id, step)
        try:
            state = json.loads(read_verified(run.store, prefix, "state.json"))
            if job and any(state.get(k) != v for k, v in job.items()):
                continue  # another stage's checkpoint (e.g. lm before grpo)
            model = load(read_verified(run.store, prefix, "model.safetensors"))
            opt = load(read_verified(run.store, prefix, "optimizer.safetensors"))
        except (IntegrityError, NotFound, StorageError, ValueError) as exc:
            warnings.warn(f"skipping checkpoint {run.store.url_of(prefix)}: {str(exc).splitlines()[0]}; trying the previous one", stacklevel=2)
            continue
        return step, model, opt, state
    return None


def start_digest(folder: str) -> str:
    """The sha256 of the weights a unit starts from (the folder's safetensors files, by name): an
    adapter's checkpoint resumes over the weights it was trained over, never over others."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(name.encode() + b"\0" + hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


FIXES = {
    "lora": "resume with the settings it was trained with (--lora RANK, --quantize-base, --set lora_alpha=/lora_dropout=/lora_targets=)",
    "start": "its adapter was trained over other starting weights (base/ or final/ changed since)",
}


def check_resumable(run: Run, path_id: str, job: dict[str, Any], strict: tuple[str, ...] = ("lora", "start")) -> None:
    """One line when the newest committed checkpoint of this stage (same mode and dataset) was
    trained with other `strict` settings (an adapter's settings, or none; the weights an adapter
    was trained over): resuming it would start over silently, or put the adapter on other weights."""
    for step, committed in reversed(run.checkpoints(path_id)):
        if not committed:
            continue
        try:
            state = json.loads(read_verified(run.store, run.checkpoint(path_id, step), "state.json"))
        except (IntegrityError, NotFound, StorageError, ValueError):
            continue
        if any(state.get(k) != job.get(k) for k in job if k not in strict):
            continue  # another stage's checkpoint
        for key in strict:
            if state.get(key) != job.get(key):
                raise ConfigurationError(f"checkpoint {step} of {path_id} was trained with {key} = {json.dumps(state.get(key))}, this run asks for {json.dumps(job.get(key))}: "
                                         f"{FIXES.get(key, 'resume with the settings it was trained with')}, or delete {run.store.url_of(run.checkpoint(path_id, step))} and the checkpoints before it to start over")
        return


def read_file(run: Run, path_id: str, step: int, name: str) -> bytes | None:
    """A file saved with a committed checkpoint (verified), or None when it has none by that name."""
    prefix = run.checkpoint(path_id, step)
    if name not in read_manifest(run.store, prefix)["files"]:
        return None
    return read_verified(run.store, prefix, name)


def prune(run: Run, path_id: str, keep: int) -> None:
    """Delete committed checkpoints beyond the newest `keep`, and uncommitted ones older than the
    newest committed (leftovers of killed writers)."""
    ckpts = run.checkpoints(path_id)
    committed = [s for s, c in ckpts if c]
    if not committed:
        return
    newest = committed[-1]
    doomed = committed[:-keep] + [s for s, c in ckpts if not c and s < newest]
    for step in doomed:
        run.store.delete_prefix(run.checkpoint(path_id, step))
