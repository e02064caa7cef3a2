"""The rollout batch object: one safetensors file a worker writes with a create-only put.

    rollouts/<path>/batches/<worker>/<n>.safetensors
      completion_ids   (N, C) int64, right-padded with -1       N = batch_size x group_size
      behaviour_logp   (N, C) float32, the sampler's log-probs of those tokens
      model_mask       (N, C) int8, episodes only: 1 where the model sampled the token, 0 where
                       the environment said it (behaviour log-prob 0), 0 in the padding
      metadata "paths" JSON: run, path, dataset, worker, the batch's position in the worker's
                       chain ("batch") and the digest of the one before it ("previous"), policy
                       version, its sha256 and nonce, prompt indices and their sha256, stated
                       rewards, dtype, sampling settings, the tensors' sha256, the worker's public
                       key and its Ed25519 signature of all of the above; episodes also
                       "environment" ("replayed", or "recorded" with each row's answers in
                       "environment_messages")

n is only a name (the worker's next free number); the chain is in the signed metadata.

Decoding reads the safetensors header by hand (8-byte length, JSON), checks the signature before
anything else, then the tensors' dtypes and sha256 and a typed schema of the metadata; nothing in
a batch is ever executed.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from typing import Any

import torch

from storage.layout import Run, validate_name

FORMAT = "paths-rollouts"
DTYPES = ("fp32", "bf16", "int8")
NUMBER = (int, float)
SCHEMA: dict[str, Any] = {  # every field a batch must carry, and its JSON type (bool is not a number here)
    "worker": str, "policy_version": int, "policy_sha256": str, "nonce": str, "batch": int, "previous": str, "prompt_index": [int], "prompt_sha256": [str],
    "rewards": [NUMBER], "dtype": str, "run": str, "path": str, "dataset": str, "group_size": int, "temperature": NUMBER, "top_p": NUMBER, "max_new_tokens": int, "key": str,
}
MAX_HEADER = 1 << 20
KEY = re.compile(r"([0-9]{6,})\.safetensors")


class Rejected(Exception):
    """A rollout batch that fails a check (the reason is the message). `attributable`: the signed
    content itself is wrong, so its signer answers for it (a strike); otherwise nobody provably
    sent it (a torn object, a bad signature) and only the folder's read budget pays."""

    def __init__(self, reason: str, attributable: bool = True):
        super().__init__(reason)
        self.attributable = attributable


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def prompt_sha(record: dict[str, Any]) -> str:
    """What names a prompt in a batch: the start of its text's sha256."""
    return sha256(record["prompt"].encode())[:16]


@dataclass
class Batch:
    """A decoded rollout batch (nothing in it checked against the trainer's own data yet)."""

    key: str
    meta: dict[str, Any]
    completion_ids: list[list[int]]
    behaviour_logp_NC: torch.Tensor
    size: int
    model_masks: list[list[int]] | None = None  # episodes: per row, 1 for the model's tokens, 0 for the environment's

    @property
    def digest(self) -> str:
        """What names this batch in its worker's chain: the sha256 of what was signed."""
        return sha256(signed_message(self.meta))

    @property
    def worker(self) -> str:
        return str(self.meta["worker"])

    @property
    def version(self) -> int:
        return int(self.meta["policy_version"])

    @property
    def position(self) -> int:
        """Its place in the worker's chain of batches (0, 1, 2, ...), which its seeds depend on."""
        return int(self.meta["batch"])


def batch_key(run: Run, path: str, worker: str, index: int) -> str:
    return f"{run.rollouts(path)}/batches/{validate_name('worker', worker)}/{index:06d}.safetensors"


def parse_key(key: str) -> tuple[str, int] | None:
    """(worker folder, object number) of rollouts/<path>/batches/<worker>/<n>.safetensors (n: six
    or more ASCII digits), else None."""
    parts = key.split("/")
    if len(parts) != 5 or parts[2] != "batches":
        return None
    m = KEY.fullmatch(parts[4])
    return (parts[3], int(m.group(1))) if m else None


def signed_message(meta: dict[str, Any]) -> bytes:
    """What a worker signs: the metadata without its signature, canonical JSON (it holds the
    tensors' sha256, so the signature covers the tensors too)."""
    body = {k: v for k, v in meta.items() if k != "signature"}
    return b"paths-rollouts/1\n" + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def digest_of(data: bytes) -> str:
    """The digest (Batch.digest) of an encoded batch."""
    return sha256(signed_message(_metadata(data)))


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    return sha256(b"".join(tensors[k].numpy().tobytes() for k in sorted(tensors)))


def encode(completion_ids: list[list[int]], behaviour_logp_NC: torch.Tensor, meta: dict[str, Any], key: Any = None, model_masks: list[list[int]] | None = None) -> bytes:
    """The batch object's bytes; signed with `key` (an Ed25519 private key) when given; episodes
    carry their `model_masks`."""
    from safetensors.torch import save

    from paths.work.rollouts.keys import public_hex, sign

    width = max(1, max(len(c) for c in completion_ids))
    ids = torch.full((len(completion_ids), width), -1, dtype=torch.int64)
    for i, c in enumerate(completion_ids):
        ids[i, : len(c)] = torch.tensor(c, dtype=torch.int64)
    tensors = {"completion_ids": ids, "behaviour_logp": behaviour_logp_NC.detach().to("cpu", torch.float32)[:, :width].contiguous()}
    if model_masks is not None:
        from paths.work.grpo import pad_rows

        tensors["model_mask"] = pad_rows(model_masks, width, "cpu", torch.int8)
    meta = {**{k: v for k, v in meta.items() if k != "signature"}, "format": FORMAT, "tensors_sha256": tensors_digest(tensors), "key": public_hex(key) if key is not None else ""}
    if key is not None:
        meta["signature"] = sign(key, signed_message(meta))
    return save(tensors, metadata={"paths": json.dumps(meta, sort_keys=True)})


def _metadata(data: bytes) -> Any:
    """The "paths" metadata of a safetensors object, read from its header without parsing tensors."""
    if len(data) < 8:
        raise Rejected("shorter than a safetensors header: truncated or not a rollout batch", attributable=False)
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(MAX_HEADER, len(data) - 8):
        raise Rejected(f"safetensors header of {n:,} bytes in a {len(data):,}-byte object: truncated or not a rollout batch", attributable=False)
    try:
        header = json.loads(data[8 : 8 + n])
        return json.loads(header["__metadata__"]["paths"])
    except (ValueError, KeyError, TypeError, RecursionError):
        raise Rejected("no paths-rollouts metadata: not a rollout batch", attributable=False) from None


def _well_typed(meta: dict[str, Any]) -> str | None:
    """The first field missing or of the wrong type, else None."""
    def fits(value: Any, kind: Any) -> bool:
        if isinstance(kind, list):
            return isinstance(value, list) and all(fits(v, kind[0]) for v in value)
        return isinstance(value, kind) and not isinstance(value, bool)

    return next((f"{name} ({type(meta.get(name)).__name__})" for name, kind in SCHEMA.items() if not fits(meta.get(name), kind)), None)


def decode(data: bytes, key: str, max_bytes: int, signer: str | None = None) -> Batch:
    """A batch object's tensors and metadata, or Rejected naming what is wrong with its bytes.
    With `signer` (a public key, hex), the metadata must carry that key's signature, checked
    before anything else in it is believed."""
    from safetensors.torch import load

    from paths.work.rollouts.keys import verify

    if len(data) > max_bytes:
        raise Rejected(f"{len(data):,} bytes, more than the {max_bytes:,} a batch of this trainer's settings can take (oversized)", attributable=False)
    meta = _metadata(data)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise Rejected("no paths-rollouts metadata: not a rollout batch", attributable=False)
    if signer is not None and (meta.get("key") != signer or not verify(signer, signed_message(meta), meta.get("signature"))):
        said = meta.get("key") or "no key"
        raise Rejected(f"not signed by the key admitted for this worker folder ({signer[:16]}...; the batch names {str(said)[:16]}): written by someone else (impersonation)", attributable=False)
    signed = signer is not None  # from here on, what is wrong is the signer's own doing
    try:
        tensors = load(data)
    except Exception as exc:  # safetensors raises its own errors for torn or hostile objects
        raise Rejected(f"not a readable safetensors object ({type(exc).__name__}: {str(exc)[:80]}): truncated or not a rollout batch", attributable=False) from None
    if set(tensors) - {"model_mask"} != {"completion_ids", "behaviour_logp"}:
        raise Rejected(f"tensors {sorted(tensors)}; a rollout batch holds completion_ids and behaviour_logp (and model_mask, for episodes)", attributable=False)
    ids, logp, mask = tensors["completion_ids"], tensors["behaviour_logp"], tensors.get("model_mask")
    if ids.dtype != torch.int64 or logp.dtype != torch.float32 or ids.dim() != 2 or ids.shape != logp.shape:
        raise Rejected(f"completion_ids {tuple(ids.shape)} {ids.dtype} and behaviour_logp {tuple(logp.shape)} {logp.dtype}: want (N, C) int64 and float32", attributable=False)
    if mask is not None and (mask.dtype != torch.int8 or mask.shape != ids.shape):
        raise Rejected(f"model_mask {tuple(mask.shape)} {mask.dtype}: want (N, C) int8, as completion_ids", attributable=False)
    if tensors_digest(tensors) != meta.get("tensors_sha256"):
        raise Rejected("tensors do not match their sha256: corrupted or edited", attributable=False)
    lengths = (ids >= 0).sum(1)
    if any(bool((row[: int(n)] < 0).any()) or bool((row[int(n):] >= 0).any()) for row, n in zip(ids, lengths)):
        raise Rejected("completion_ids are not right-padded with -1", attributable=signed)
    wrong = _well_typed(meta)
    if wrong is not None:
        raise Rejected(f"metadata lacks or garbles {wrong}", attributable=signed)
    if meta["policy_version"] < 0 or meta["batch"] < 0 or len(meta["prompt_sha256"]) != len(meta["prompt_index"]):
        raise Rejected(f"policy version {meta['policy_version']}, batch {meta['batch']}, or prompt fields of different lengths", attributable=signed)
    completions = [row[: int(n)].tolist() for row, n in zip(ids, lengths)]
    masks = None
    if mask is not None:
        if bool(((mask != 0) & (mask != 1)).any()) or bool(((ids < 0) & (mask != 0)).any()):
            raise Rejected("model_mask holds values other than 0 and 1, or marks padding", attributable=signed)
        masks = [row[: int(n)].tolist() for row, n in zip(mask, lengths)]
    return Batch(key, meta, completions, logp, len(data), masks)


def batch_bytes_limit(cfg: Any, episodes: bool = False) -> int:
    """The largest honest batch of these settings: its tensors, plus room for the metadata (for
    episodes, their masks and recorded environment answers too)."""
    n = cfg.batch_size * cfg.group_size
    return n * cfg.max_new_tokens * (8 + 4 + episodes) + 64 * 1024 + 2 * n * 64 + episodes * MAX_HEADER // 2
