"""Everything a rollout batch is bound to, derived from numbers nobody can grind.

    nonce       = HMAC(trainer's salt, path / version / sha256 of the weights)   drawn by the trainer
    batch seed  = sha256(nonce / worker name / worker key / chain position)     fixed by the trainer's nonce
    prompts     = batch_size draws from the batch seed                          the worker picks none
    uniforms    = per completion row, max_new_tokens numbers from sha256(batch seed / row)

A worker samples token t of row r with uniforms[r, t] (inverse CDF, paths.work.sampling), so the
trainer knows which token each position had to be, given the probabilities: a moved, edited,
invented or cherry-picked completion does not come out of its seeds. The salt stays in the
trainer's checkpoints, so a resumed trainer publishes the same nonces for the same weights.
"""

from __future__ import annotations

import hashlib
import hmac
import random
from typing import Any

import numpy as np
import torch

from storage.layout import Run

U_MAX = float(np.nextafter(np.float32(1.0), np.float32(0.0)))  # the largest float32 below 1


def run_id(run: Run) -> str:
    """What names a run in its batches whatever URL a machine reaches it by: run.json's creation."""
    meta = run.read_meta()
    return f"{meta.get('created_at')}-{meta.get('seed')}"


def nonce(salt: str, path: str, version: int, weights_sha256: str) -> str:
    """Policy version `version`'s nonce: the trainer's secret salt over what the version is."""
    return hmac.new(bytes.fromhex(salt), f"{path}/{version}/{weights_sha256}".encode(), hashlib.sha256).hexdigest()[:32]


def batch_seed(nonce_hex: str, worker: str, key: str, position: int) -> bytes:
    """The seed of the batch at `position` of a worker's chain, sampled from the version with
    `nonce_hex` (`key`: the worker's public key, empty for an unsigned batch of an open run)."""
    return hashlib.sha256(f"paths-batch/{nonce_hex}/{worker}/{key}/{position}".encode()).digest()


def pick_prompts(seed: bytes, count: int, total: int, mixture: Any = None) -> list[int]:
    """The prompts of a batch: `count` indices into the path's `total` training prompts (in the
    sources' ratio when a `mixture.Mixture` is given)."""
    rng = random.Random(int.from_bytes(hashlib.sha256(b"prompts/" + seed).digest()[:8], "big"))
    if mixture is not None:
        return mixture.pick(count, rng)
    return [rng.randrange(total) for _ in range(count)]


def row_uniforms(seed: bytes, rows: int | list[int], length: int) -> torch.Tensor:
    """(rows, length) float32 numbers in [0, 1): row r's from its own PCG64 stream, so a row's
    numbers do not depend on how the rows are chunked, batched or ordered on the worker. `rows`: a
    count (rows 0 to rows - 1), or the rows wanted (the seed check's)."""
    which = range(rows) if isinstance(rows, int) else rows
    out = np.empty((len(which), length), dtype=np.float32)
    for i, r in enumerate(which):
        stream = np.random.Generator(np.random.PCG64(int.from_bytes(hashlib.sha256(seed + b"/row/%d" % r).digest()[:16], "big")))
        out[i] = np.minimum(stream.random(length).astype(np.float32), U_MAX)  # float32 rounding must not reach 1
    return torch.from_numpy(out)


def row_hash(prompt_ids: list[int], completion_ids: list[int], seed: bytes, row: int) -> str:
    """What one sampled row is: its prompt and completion tokens and the numbers it was drawn with.
    Two honest rows may hold the same tokens (a short answer sampled twice), never the same seed."""
    h = hashlib.sha256(seed + b"/row/%d/" % row)
    h.update(np.asarray(prompt_ids, dtype=np.int64).tobytes() + b"|" + np.asarray(completion_ids, dtype=np.int64).tobytes())
    return h.hexdigest()[:24]
