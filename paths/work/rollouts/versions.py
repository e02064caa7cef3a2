"""What a policy version ships, and how a worker rebuilds the weights from it.

Three kinds, each a safetensors file written and read through a local file (streamed, never the
whole blob in memory):
- `full`: every tensor in fp32 (the first version a trainer publishes, and every
  `policy_snapshot_every`-th after it);
- `delta`: against the version before it, for a full fine-tune. A matrix ships its change as int8
  with one bf16 scale per row, a vector its new values, an unchanged tensor nothing; the file is
  zstd-compressed. The trainer keeps the weights the workers rebuild (`published`) and encodes
  each change against them, so rounding never accumulates: what it leaves out of one version it
  ships in the next;
- `adapter`: a LoRA unit's adapter (and any tensor trained in full beside it) in bf16, merged by
  workers into the unit's frozen base (fp32), which is written once under `policy/<path>/base-<sha>/`.

A version's `sha256` names the weights it stands for: `state_digest` of them for full and delta
(workers check what they rebuilt against it), and the digest of its base and adapter files for an
adapter (the merge is the same code on both sides: paths.adapters.merge).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from typing import Any, Iterable

import torch

from paths.errors import DataError
from storage.store import Store

CHUNK = 1 << 20


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's tensors as fp32 on the CPU, each storage once (a tied head is its embedding)."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in model.state_dict().items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset())
        if ident in seen:
            continue
        seen.add(ident)
        out[name] = t.detach().to("cpu", torch.float32).contiguous()
    return out


def assign(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` into the model's own (each name `weights` gives); one line when they are not
    exactly its tensors."""
    own = weights(model)
    if own.keys() != tensors.keys() or any(own[k].shape != tensors[k].shape for k in own):
        missing = sorted(own.keys() ^ tensors.keys())[:1] or [next(k for k in own if own[k].shape != tensors[k].shape)]
        raise DataError(f"a policy version's tensors do not fit this path's model (first: {missing[0]}): the version is from another run or path")
    state = model.state_dict()
    with torch.no_grad():
        for name, value in tensors.items():
            state[name].copy_(value)


def state_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors in name order: name, dtype, shape and bytes of each."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


# -- delta encoding -------------------------------------------------------------------------------
def encode_delta(new: dict[str, torch.Tensor], published: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The change from `published` to `new` (int8 rows + bf16 scales for matrices, exact vectors,
    nothing for unchanged tensors); `published` is moved to what a worker rebuilds from it."""
    out = {}
    for name, w in new.items():
        old = published[name]
        if torch.equal(w, old):
            continue
        if w.dim() < 2:
            out[name] = w.clone()
            published[name] = w.clone()
            continue
        d_OX = (w - old).reshape(w.shape[0], -1)
        s_O = (d_OX.abs().amax(dim=1) / 127).to(torch.bfloat16)  # the scale as shipped (bf16): q is rounded against it, what it misses ships next time
        q_OX = torch.round(d_OX / s_O.float().clamp_min(torch.finfo(torch.float32).tiny)[:, None]).clamp(-127, 127).to(torch.int8)
        out[f"{name}.q"], out[f"{name}.s"] = q_OX, s_O
        _add_rows(old, q_OX, s_O)
    return out


def apply_delta(state: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> None:
    """Rebuild in place what `encode_delta` left its `published` at."""
    for name, value in delta.items():
        if name.endswith(".s"):
            continue
        if name.endswith(".q"):
            base = name.removesuffix(".q")
            _add_rows(state[base], value, delta[f"{base}.s"])
        else:
            state[name].copy_(value)


def _add_rows(w: torch.Tensor, q_OX: torch.Tensor, s_O: torch.Tensor) -> None:
    """w += q s, row by row: the one arithmetic trainer and workers both run."""
    w.view(w.shape[0], -1).add_(q_OX.to(w.device).float() * s_O.to(w.device).float()[:, None])


# -- files ----------------------------------------------------------------------------------------
def write_tensors(store: Store, key: str, tensors: dict[str, torch.Tensor], compress: bool) -> dict[str, Any]:
    """Upload `tensors` as safetensors (zstd-compressed when `compress`) through a local file;
    returns {bytes, sha256} of what was uploaded."""
    from safetensors.torch import save_file

    folder = tempfile.mkdtemp(prefix="paths-policy-")
    try:
        raw = os.path.join(folder, "t.safetensors")
        save_file(tensors, raw)
        path = raw
        if compress:
            import zstandard

            path = raw + ".zst"
            with open(raw, "rb") as src, open(path, "wb") as dst:
                zstandard.ZstdCompressor(level=3).copy_stream(src, dst)
        digest = _file_sha256(path)
        size = os.path.getsize(path)
        store.upload(key, path)
        return {"bytes": size, "sha256": digest}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def read_tensors(store: Store, key: str, sha256: str, compress: bool) -> dict[str, torch.Tensor]:
    """Download a file `write_tensors` wrote, streamed to a local file and checked against `sha256`."""
    from safetensors.torch import load_file

    folder = tempfile.mkdtemp(prefix="paths-policy-")
    try:
        path = os.path.join(folder, "t")
        h = hashlib.sha256()
        with open(path, "wb") as dst:
            for block in _blocks(store, key):
                h.update(block)
                dst.write(block)
        if h.hexdigest() != sha256:
            raise DataError(f"{store.url_of(key)} does not match its policy.json checksum: the trainer publishes a new version next step")
        if compress:
            import zstandard

            with open(path, "rb") as src, open(path + ".st", "wb") as out:
                zstandard.ZstdDecompressor().copy_stream(src, out)
            path += ".st"
        return load_file(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _blocks(store: Store, key: str) -> Iterable[bytes]:
    yield from store.iter_chunks(key, CHUNK)


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()
