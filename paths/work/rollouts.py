"""Asynchronous RL through the bucket: policy versions, rollout batches, and rollouts nobody has to trust.

    trainer (paths train --mode grpo --rollouts store)          rollout workers (paths rollout), any machines
      publishes policy/<path>/v<N>/ after each step  ------>      read latest.json, load v<N> (checked)
      consumes batches at most max_async versions old <------     sample G completions per prompt, score them,
      verifies each one, masks trainer/sampler mismatch           create-only put rollouts/<path>/batches/<worker>/<b>

A policy version is `model.safetensors` and `policy.json` (its sha256, written last: a version
exists once its policy.json does); `latest.json` names the newest. A rollout batch is one
safetensors object: the completion token ids, their mask and the behaviour log-probs, with JSON
metadata (run, path, dataset, policy version, worker, batch number, the prompts' indices in the
path's prompt shard and the sha256 of each prompt, the stated rewards, dtype, sampling settings,
the sha256 of the tensors). Workers never learn of each other: a batch key is their own name
and number.

The trainer trusts nothing in a batch: it rebuilds each sequence from its own prompt tokens,
recomputes every reward from the completion text with its own verifiers (stated rewards that
differ reject the batch), recomputes the behaviour log-probs of `verify_rows` completions under
the stated version (sampled in the stated dtype) and rejects a batch beyond `verify_tolerance`;
schema, sizes, checksums, run, path and version are checked first. A rejected batch is recorded
in rollouts/<path>/rejected/ with its worker and reason, and a worker rejected `max_rejections`
times is ignored. Which batches were consumed, discarded or rejected is the trainer's data
position, saved in its checkpoints: after a kill and a takeover no batch is used twice or lost.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from paths.errors import ConfigurationError, DataError, NotFound, PathsError, PreconditionFailed
from paths.trainer import Callback
from paths.work.grpo import GRPOStep, Samples, grpo_backward, logprobs_in_chunks, pack, score_samples, to_rollout
from paths.work.quantize import int8_copy
from paths.work.rewards import Reward
from paths.work.sampling import complete
from storage.layout import Run

FORMAT = "paths-rollouts"
DTYPES = ("fp32", "bf16", "int8")
POLL = 0.2  # seconds between listings while waiting


class Rejected(Exception):
    """A rollout batch that fails a check (the reason is the message)."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run_id(run: Run) -> str:
    """What names a run in its batches whatever URL a machine reaches it by: run.json's creation."""
    meta = run.read_meta()
    return f"{meta.get('created_at')}-{meta.get('seed')}"


# -- policy versions --------------------------------------------------------------------------------
def version_key(run: Run, path: str, version: int) -> str:
    return f"{run.policy(path)}/v{version:08d}"


def publish(run: Run, path: str, version: int, model: torch.nn.Module, **meta: Any) -> dict[str, Any]:
    """Write policy version `version` (weights, then policy.json with their sha256), then point
    latest.json at it."""
    from safetensors.torch import save

    prefix = version_key(run, path, version)
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    data = save(state)
    run.store.write(f"{prefix}/model.safetensors", data)
    record = {"format": FORMAT, "path": path, "version": version, "sha256": sha256(data), "bytes": len(data), "at": time.time(), **meta}
    run.store.write(f"{prefix}/policy.json", json.dumps(record, sort_keys=True).encode())
    run.store.write(f"{run.policy(path)}/latest.json", json.dumps(record, sort_keys=True).encode())
    return record


def latest(run: Run, path: str) -> dict[str, Any] | None:
    """latest.json of a path's policy, or None before the trainer published one."""
    try:
        return json.loads(run.store.read(f"{run.policy(path)}/latest.json"))
    except NotFound:
        return None


def version_record(run: Run, path: str, version: int) -> dict[str, Any] | None:
    """policy.json of a version, or None when it was never published (or is pruned)."""
    try:
        return json.loads(run.store.read(f"{version_key(run, path, version)}/policy.json"))
    except NotFound:
        return None


def load_version(run: Run, path: str, version: int, model: torch.nn.Module) -> dict[str, Any]:
    """Load version `version` into `model`, its bytes checked against policy.json."""
    from safetensors.torch import load

    record = version_record(run, path, version)
    if record is None:
        raise NotFound(f"policy version {version} of {path} is not in {run.url} (pruned, or never published): read latest.json again")
    data = run.store.read(f"{version_key(run, path, version)}/model.safetensors")
    if sha256(data) != record["sha256"]:
        raise DataError(f"{run.store.url_of(version_key(run, path, version))}/model.safetensors does not match its policy.json checksum: the trainer publishes it again next step")
    model.load_state_dict(load(data), strict=True)
    return record


def published_versions(run: Run, path: str) -> list[int]:
    return sorted(int(o.key.split("/")[2][1:]) for o in run.store.list(run.policy(path)) if o.key.endswith("/policy.json"))


def prune(run: Run, path: str, keep: Callable[[int], bool]) -> int:
    """Delete the versions `keep` says nobody may use any more; how many."""
    gone = 0
    for v in published_versions(run, path):
        if not keep(v):
            run.store.delete(f"{version_key(run, path, v)}/policy.json")  # the marker first: a half-deleted version does not exist
            run.store.delete(f"{version_key(run, path, v)}/model.safetensors")
            gone += 1
    return gone


def sampler(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """The model as a rollout worker samples with it: fp32, bf16 weights, or int8 dynamically
    quantized linear layers and experts (QuaRL: an 8-bit actor, a full-precision learner; see
    quantize.py). A copy for int8."""
    if dtype == "fp32":
        return model.float()
    if dtype == "bf16":
        return model.to(torch.bfloat16)
    if dtype == "int8":
        return int8_copy(model)
    raise ConfigurationError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def copy_as(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """fp32: the model itself; bf16: a bf16 copy (the fp32 weights stay for the next version)."""
    if dtype == "fp32":
        return model
    import copy

    return copy.deepcopy(model).to(torch.bfloat16)


# -- rollout batch objects ----------------------------------------------------------------------------
@dataclass
class Batch:
    """A decoded rollout batch (nothing in it checked against the trainer's own data yet)."""

    key: str
    meta: dict[str, Any]
    completion_ids: list[list[int]]
    behaviour_logp_NC: torch.Tensor
    size: int

    @property
    def worker(self) -> str:
        return str(self.meta["worker"])

    @property
    def version(self) -> int:
        return int(self.meta["policy_version"])


def batch_key(run: Run, path: str, worker: str, index: int) -> str:
    from storage.layout import validate_name

    return f"{run.rollouts(path)}/batches/{validate_name('worker', worker)}/{index:06d}.safetensors"


def encode(completion_ids: list[list[int]], behaviour_logp_NC: torch.Tensor, meta: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    width = max(1, max(len(c) for c in completion_ids))
    ids = torch.full((len(completion_ids), width), -1, dtype=torch.int64)
    for i, c in enumerate(completion_ids):
        ids[i, : len(c)] = torch.tensor(c, dtype=torch.int64)
    tensors = {"completion_ids": ids, "behaviour_logp": behaviour_logp_NC.detach().to("cpu", torch.float32).contiguous()}
    digest = sha256(b"".join(tensors[k].numpy().tobytes() for k in sorted(tensors)))
    return save(tensors, metadata={"paths": json.dumps({**meta, "format": FORMAT, "tensors_sha256": digest}, sort_keys=True)})


def decode(data: bytes, key: str, max_bytes: int) -> Batch:
    """A batch object's tensors and metadata, or Rejected naming what is wrong with its bytes."""
    from safetensors import safe_open
    from safetensors.torch import load

    if len(data) > max_bytes:
        raise Rejected(f"{len(data):,} bytes, more than the {max_bytes:,} a batch of this trainer's settings can take (oversized)")
    try:
        tensors = load(data)
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:  # the metadata reader wants a file
            f.write(data)
            f.flush()
            with safe_open(f.name, "pt") as st:
                raw = (st.metadata() or {}).get("paths")
        meta = json.loads(raw) if raw else None
    except Exception as exc:  # safetensors raises its own errors for torn or hostile headers
        raise Rejected(f"not a readable safetensors object ({type(exc).__name__}: {str(exc)[:80]}): truncated or not a rollout batch") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise Rejected("no paths-rollouts metadata: not a rollout batch")
    if set(tensors) != {"completion_ids", "behaviour_logp"}:
        raise Rejected(f"tensors {sorted(tensors)}; a rollout batch holds completion_ids and behaviour_logp")
    ids, logp = tensors["completion_ids"], tensors["behaviour_logp"]
    digest = sha256(b"".join(tensors[k].numpy().tobytes() for k in sorted(tensors)))
    if digest != meta.get("tensors_sha256"):
        raise Rejected("tensors do not match their sha256: corrupted or edited")
    if ids.dtype != torch.int64 or logp.dtype != torch.float32 or ids.dim() != 2 or ids.shape != logp.shape:
        raise Rejected(f"completion_ids {tuple(ids.shape)} {ids.dtype} and behaviour_logp {tuple(logp.shape)} {logp.dtype}: want (N, C) int64 and float32")
    lengths = (ids >= 0).sum(1)
    if any(bool((row[: int(n)] < 0).any()) or bool((row[int(n):] >= 0).any()) for row, n in zip(ids, lengths)):
        raise Rejected("completion_ids are not right-padded with -1")
    try:
        for name in ("worker", "policy_version", "batch", "prompt_index", "prompt_sha256", "rewards", "dtype", "run", "path", "dataset", "group_size", "temperature", "top_p"):
            meta[name]
        version, index = int(meta["policy_version"]), int(meta["batch"])
    except (KeyError, TypeError, ValueError) as exc:
        raise Rejected(f"metadata lacks or garbles {exc}") from None
    if version < 0 or index < 0:
        raise Rejected(f"policy version {version}, batch {index}: negative")
    completions = [row[: int(n)].tolist() for row, n in zip(ids, lengths)]
    return Batch(key, meta, completions, logp, len(data))


def batch_bytes_limit(cfg: Any) -> int:
    """The largest honest batch of these settings: its tensors, plus room for the metadata."""
    n = cfg.batch_size * cfg.group_size
    return n * cfg.max_new_tokens * (8 + 4) + 64 * 1024 + 2 * n * 64


# -- the rollout worker -------------------------------------------------------------------------------
def pick_prompts(worker: str, index: int, count: int, total: int) -> list[int]:
    """The prompts of a worker's batch `index`: deterministic per (worker, batch), so a restarted
    worker redraws the same ones and two workers draw different ones."""
    rng = random.Random(int.from_bytes(hashlib.sha256(f"{worker}\0{index}".encode()).digest()[:8], "big"))
    return [rng.randrange(total) for _ in range(count)]


def prompt_sha(record: dict[str, Any]) -> str:
    return sha256(record["prompt"].encode())[:16]


def next_index(run: Run, path: str, worker: str) -> int:
    """The first batch number this worker has not written (a restarted worker goes on from there)."""
    prefix = f"{run.rollouts(path)}/batches/{worker}"
    done = [int(o.key.rsplit("/", 1)[1].split(".")[0]) for o in run.store.list(prefix) if o.key.endswith(".safetensors")]
    return max(done) + 1 if done else 0


def finished(run: Run, path: str) -> bool:
    """Whether the path's claim says its training is done."""
    from paths.work.claims import read_claim

    record, _ = read_claim(run, path)
    return record is not None and record.get("state") == "done"


def rollout_worker(run: Run, path: str, dataset: str, cfg: Any, rewards: list[Reward], *, worker: str, dtype: str = "fp32", batches: int = 1,
                   wait: float = 600.0, on_batch: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Write `batches` rollout batches of `path` (each: batch_size prompts x group_size completions
    sampled from the newest policy version in `dtype`), reloading whenever the policy moved on and
    dropping a batch that would arrive more than max_async versions late; stop early once the
    path's training is done. Returns a summary."""
    import os
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from paths.models import materialize
    from paths.work.sampling import check_prompts
    from sharding.dataset import dataset_manifest, path_entry, read_prompts

    if dtype not in DTYPES:
        raise ConfigurationError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if batches < 1:
        raise ConfigurationError(f"--batches must be >= 1, got {batches}")
    manifest = dataset_manifest(run, dataset)
    if manifest.get("data_kind") != "prompts":
        raise ConfigurationError(f"dataset {dataset!r} holds documents: a rollout worker needs a prompt dataset (`paths shard --kind prompts`)")
    from paths.units import data_id

    try:
        shard = data_id(run, path, manifest)  # a domain expert reads its domain's shard
    except NotFound:
        shard = path
    if shard not in manifest.get("paths", {}):
        raise ConfigurationError(f"path {path} has no prompt shard in dataset {dataset!r}: route prompts to it, or run the worker for another path")
    path_entry(run, dataset, shard)
    records = read_prompts(run, dataset, shard, "train")
    if not records:
        raise ConfigurationError(f"path {path} has no training prompts in dataset {dataset!r}: shard more prompts, or run the worker for another path")
    hf_logging.disable_progress_bar()
    local = tempfile.mkdtemp(prefix=f"paths-rollout-{path}-")
    try:
        materialize(run, path, os.path.join(local, "init"))
        policy = AutoModelForCausalLM.from_pretrained(os.path.join(local, "init"), dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(local, "init"))
        check_prompts(records, rewards, dataset, policy.config.max_position_embeddings, cfg.max_new_tokens)
        rid = run_id(run)
        loaded, model = None, None
        index = next_index(run, path, worker)
        written, dropped, reloads, tokens, seconds = 0, 0, 0, 0, 0.0
        seen, since = None, 0  # batches written since the trainer last said how many wait
        deadline = time.time() + wait
        while written < batches:
            if finished(run, path):
                break  # the trainer is done with the path: nobody will use more
            head = latest(run, path)
            if head is None:
                if time.time() > deadline:
                    raise NotFound(f"no policy of {path} was published in {run.url} within {wait:.0f}s: start `paths train --mode grpo --rollouts store` for it")
                time.sleep(POLL)
                continue
            if loaded is None or head["version"] != loaded["version"]:
                try:
                    loaded = load_version(run, path, int(head["version"]), policy)
                except (NotFound, DataError):
                    time.sleep(POLL)  # pruned or being replaced meanwhile: read latest again
                    continue
                model, reloads = sampler(policy, dtype), reloads + 1
            said = (head["version"], head.get("at"))
            if said != seen:
                seen, since = said, 0
            if int(head.get("pending", 0)) + since >= (int(head.get("max_async", cfg.max_async)) + 1) * int(head.get("needs", 1)):
                waited = time.time()
                while (lambda h: (h["version"], h.get("at")))(latest(run, path) or head) == said and time.time() - waited < wait and not finished(run, path):
                    time.sleep(POLL)  # enough batches wait for the trainer: more would only go stale
                continue
            t0 = time.perf_counter()
            picked = pick_prompts(worker, index, cfg.batch_size, len(records))
            recs = [records[i] for i in picked]
            with torch.inference_mode():
                completion_ids, truncated = complete(model, recs, cfg.group_size, tokenizer, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                                     chunk=cfg.generation_batch_size or cfg.batch_size * cfg.group_size)
                ids, attention, p, _ = pack(recs, completion_ids, cfg.group_size, tokenizer.pad_token_id, torch.device("cpu"))
                logp = logprobs_in_chunks(model, ids, attention, p, cfg.temperature, cfg.batch_size * cfg.group_size)
            samples = score_samples(recs, completion_ids, truncated, rewards, cfg, tokenizer)
            seconds += time.perf_counter() - t0
            now = latest(run, path)
            if now is not None and int(now["version"]) - int(loaded["version"]) > int(now.get("max_async", cfg.max_async)):
                dropped += 1  # it would arrive too late to be used: reload first
                continue
            meta = {"run": rid, "path": path, "dataset": dataset, "worker": worker, "batch": index, "policy_version": int(loaded["version"]), "policy_sha256": loaded["sha256"], "dtype": dtype,
                    "prompt_index": picked, "prompt_sha256": [prompt_sha(r) for r in recs], "rewards": samples.rewards, "group_size": cfg.group_size,
                    "temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens, "at": time.time()}
            data = encode(completion_ids, logp[:, : max(1, max(len(c) for c in completion_ids))], meta)
            try:
                run.store.put_if_absent(batch_key(run, path, worker, index), data)
            except PreconditionFailed:
                index = next_index(run, path, worker)  # another process runs under this worker name: go on after it
                continue
            written, index, since = written + 1, index + 1, since + 1
            tokens += sum(len(c) for c in completion_ids)
            if on_batch is not None:
                on_batch({"batch": index - 1, "version": meta["policy_version"], "reward_mean": sum(samples.rewards) / len(samples.rewards), "tokens": tokens, "tokens_per_s": tokens / max(1e-9, seconds)})
        return {"path": path, "worker": worker, "dtype": dtype, "batches": written, "dropped_stale": dropped, "reloads": reloads, "tokens": tokens, "tokens_per_s": tokens / max(1e-9, seconds),
                "last_version": loaded["version"] if loaded else None}
    finally:
        shutil.rmtree(local, ignore_errors=True)


# -- the trainer's side -------------------------------------------------------------------------------
@dataclass
class Verified:
    """A batch that passed every check: scored by the trainer's verifiers, as Samples."""

    key: str
    worker: str
    version: int
    samples: Samples
    behaviour_logp: list[list[float]]


@dataclass
class StoreRollouts:
    """The asynchronous trainer's data: rollout batches from the store, checked, in a
    deterministic order (oldest usable version first, then key). Its state (consumed, discarded
    and rejected keys, rejections per worker, steps taken) is saved in every checkpoint."""

    run: Run
    path: str
    dataset: str
    cfg: Any
    records: list[dict[str, Any]]
    rewards: list[Reward]
    tokenizer: Any
    make_model: Callable[[], torch.nn.Module]  # a fresh fp32 model of the path (to recompute log-probs)
    steps: int = 0
    consumed: list[str] = field(default_factory=list)
    discarded: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    strikes: dict[str, int] = field(default_factory=dict)
    external: dict[str, int] = field(default_factory=dict)  # SAPO: other paths' batches -> groups of them taken
    pending: int = 0  # batches left in the store after the last take that the next step can use (told to the workers)
    on_starving: Callable[[], None] | None = None
    _rid: str = ""
    _other_records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    _verifier: tuple[int, str, torch.nn.Module] | None = None
    _weights: torch.nn.Module | None = None  # one fp32 model the versions are loaded into

    def __post_init__(self) -> None:
        self._rid = run_id(self.run)

    # the Batches protocol: the trainer saves and restores the position
    def __iter__(self) -> "StoreRollouts":
        return self

    def __next__(self) -> dict[str, Any]:
        raise TypeError("StoreRollouts hands out verified batches through take(), not next()")

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "consumed": list(self.consumed), "discarded": list(self.discarded), "rejected": dict(self.rejected), "strikes": dict(self.strikes),
                "external": dict(self.external)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.consumed, self.discarded = int(state["steps"]), list(state["consumed"]), list(state["discarded"])
        self.rejected, self.strikes = dict(state["rejected"]), {k: int(v) for k, v in state["strikes"].items()}
        self.external = {k: int(v) for k, v in state.get("external", {}).items()}

    @property
    def ignored(self) -> set[str]:
        return {w for w, n in self.strikes.items() if n >= self.cfg.max_rejections}

    def take(self, count: int, wait: float) -> tuple[list[Verified], dict[str, float]]:
        """Up to `count` verified batches usable at this step (policy version within max_async of
        it), waiting up to `wait` seconds for them; stale ones are discarded and bad ones rejected
        on the way."""
        version, taken, starving = self.steps, [], False
        stats = {"stale_batches": 0.0, "rejected_batches": 0.0}
        deadline = time.time() + wait
        while len(taken) < count:
            seen = set(self.consumed) | set(self.discarded) | set(self.rejected)
            fresh = []
            for o in self.run.store.list(f"{self.run.rollouts(self.path)}/batches"):
                if o.key in seen or not o.key.endswith(".safetensors"):
                    continue
                worker = o.key.split("/")[-2]
                if worker in self.ignored:
                    continue
                fresh.append(o.key)
            progressed = False
            candidates = []
            for key in sorted(fresh):
                try:
                    batch = decode(self.run.store.read(key), key, batch_bytes_limit(self.cfg))
                except Rejected as exc:
                    self._reject(key, key.split("/")[-2], str(exc))
                    stats["rejected_batches"] += 1
                    progressed = True
                    continue
                if batch.worker != key.split("/")[-2] or int(batch.meta["batch"]) != int(key.rsplit("/", 1)[1].split(".")[0]):
                    self._reject(key, key.split("/")[-2], f"states worker {batch.worker!r} batch {batch.meta['batch']}, but lies under another key")
                    stats["rejected_batches"] += 1
                    progressed = True
                    continue
                if batch.version > version:
                    if version_record(self.run, self.path, batch.version) is None:
                        self._reject(key, batch.worker, f"policy version {batch.version} was never published (the trainer is at {version})")
                        stats["rejected_batches"] += 1
                        progressed = True
                    continue  # published by this trainer before a restart: usable once it is there again
                record = version_record(self.run, self.path, batch.version)
                if version - batch.version > self.cfg.max_async or (record is not None and batch.meta.get("policy_sha256") not in (None, record["sha256"])):
                    self.discarded.append(key)  # too old, or sampled from a version a restarted trainer has published anew
                    stats["stale_batches"] += 1
                    progressed = True
                    continue
                candidates.append(batch)
            for batch in sorted(candidates, key=lambda b: (b.version, b.key)):
                if len(taken) == count:
                    break
                if batch.worker in self.ignored:  # rejected max_rejections times meanwhile
                    continue
                try:
                    taken.append(self.verify(batch))
                    self.consumed.append(batch.key)
                except Rejected as exc:
                    self._reject(batch.key, batch.worker, str(exc))
                    stats["rejected_batches"] += 1
                progressed = True
            used = {v.key for v in taken}
            self.pending = sum(1 for b in candidates if b.key not in used and b.version >= version + 1 - self.cfg.max_async)  # still usable next step
            if len(taken) < count and not progressed:
                if not starving and self.on_starving is not None:
                    self.on_starving()  # tell the workers nothing usable waits, or they hold back
                starving = True
                if time.time() >= deadline:
                    break
                time.sleep(POLL)
        return taken, stats

    def take_external(self, groups: int) -> Samples | None:
        """SAPO's shared experience: `groups` prompt groups from other paths' (and experts')
        rollout batches, in key order, each group used once: their decoded prompt text, answer
        and completions, re-tokenized and re-scored with this trainer's verifiers (nothing they
        state is used). None when no other path has written any yet."""
        cfg, tok = self.cfg, self.tokenizer
        records, completions = [], []
        for o in self.run.store.list("rollouts"):
            parts = o.key.split("/")
            if len(records) >= groups:
                break
            if len(parts) != 5 or parts[2] != "batches" or parts[1] == self.path or not o.key.endswith(".safetensors"):
                continue
            used = self.external.get(o.key, 0)
            if used < 0:
                continue  # every group of it taken
            try:
                batch = decode(self.run.store.read(o.key), o.key, batch_bytes_limit(cfg) * 4)
                mine = self._records_of(parts[1], batch.meta["dataset"])
            except (Rejected, PathsError):
                continue  # not readable, or a path whose prompts this trainer cannot read: not shared experience
            g = int(batch.meta["group_size"])
            index = batch.meta["prompt_index"]
            while used < len(index) and len(records) < groups:
                i = index[used]
                if isinstance(i, int) and 0 <= i < len(mine) and prompt_sha(mine[i]) == batch.meta["prompt_sha256"][used] and g >= cfg.group_size:
                    theirs = mine[i]
                    ids = tok(theirs["prompt"], add_special_tokens=False)["input_ids"] if "ids" not in theirs else theirs["ids"]
                    records.append({**theirs, "ids": ids})
                    texts = tok.batch_decode(batch.completion_ids[used * g : used * g + cfg.group_size], skip_special_tokens=True)
                    for text, original in zip(texts, batch.completion_ids[used * g : used * g + cfg.group_size]):
                        again = tok(text, add_special_tokens=False)["input_ids"][: cfg.max_new_tokens - 1]
                        completions.append(again + ([tok.eos_token_id] if original[-1] == tok.eos_token_id or not again else []))
                used += 1
            self.external[o.key] = -1 if used >= len(index) else used
        if not records:
            return None
        truncated = [c[-1] != tok.eos_token_id for c in completions]
        return score_samples(records, completions, truncated, self.rewards, cfg, tok)

    def _records_of(self, path: str, dataset: str) -> list[dict[str, Any]]:
        from paths.units import data_id
        from sharding.dataset import dataset_manifest, read_prompts

        key = f"{dataset}/{path}"
        if key not in self._other_records:
            self._other_records[key] = read_prompts(self.run, dataset, data_id(self.run, path, dataset_manifest(self.run, dataset)), "train")
        return self._other_records[key]

    def _reject(self, key: str, worker: str, reason: str) -> None:
        self.rejected[key] = reason
        self.strikes[worker] = self.strikes.get(worker, 0) + 1
        record = {"key": key, "worker": worker, "reason": reason, "trainer_step": self.steps, "at": time.time(), "ignored": self.strikes[worker] >= self.cfg.max_rejections}
        if not self.run.store.read_only:
            self.run.store.write(f"{self.run.rollouts(self.path)}/rejected/{worker}/{key.rsplit('/', 1)[1].split('.')[0]}.json", json.dumps(record, sort_keys=True).encode())

    def verify(self, batch: Batch) -> Verified:
        """Every check against the trainer's own data and verifiers; Rejected on the first failure."""
        cfg, meta = self.cfg, batch.meta
        if meta["run"] != self._rid or meta["path"] != self.path or meta["dataset"] != self.dataset:
            raise Rejected(f"for run {meta['run']}, path {meta['path']}, dataset {meta['dataset']}; this trainer is {self._rid}, {self.path}, {self.dataset}")
        if meta["dtype"] not in DTYPES:
            raise Rejected(f"dtype {meta['dtype']!r} is not one of {', '.join(DTYPES)}")
        if int(meta["group_size"]) != cfg.group_size or float(meta["temperature"]) != cfg.temperature or float(meta["top_p"]) != cfg.top_p:
            raise Rejected(f"sampled with group_size {meta['group_size']}, temperature {meta['temperature']}, top_p {meta['top_p']}; the trainer uses {cfg.group_size}, {cfg.temperature}, {cfg.top_p}")
        index, shas = meta["prompt_index"], meta["prompt_sha256"]
        n = len(batch.completion_ids)
        if not isinstance(index, list) or len(index) != cfg.batch_size or len(shas) != len(index) or n != len(index) * cfg.group_size:
            raise Rejected(f"{len(index) if isinstance(index, list) else '?'} prompts x {cfg.group_size} should be {n} completions, for batch_size {cfg.batch_size}")
        if batch.behaviour_logp_NC.shape[1] > cfg.max_new_tokens or any(len(c) > cfg.max_new_tokens or len(c) == 0 for c in batch.completion_ids):
            raise Rejected(f"a completion is empty or longer than max_new_tokens {cfg.max_new_tokens}")
        vocab = self.tokenizer.vocab_size if hasattr(self.tokenizer, "vocab_size") else None
        if vocab and any(t >= len(self.tokenizer) for c in batch.completion_ids for t in c):
            raise Rejected("completion token ids outside the vocabulary")
        records = []
        for i, s in zip(index, shas):
            if not isinstance(i, int) or not 0 <= i < len(self.records):
                raise Rejected(f"prompt index {i!r} is not in the path's {len(self.records)} training prompts")
            if prompt_sha(self.records[i]) != s:
                raise Rejected(f"prompt {i} differs from the path's own prompt {i} (another shard?)")
            records.append(self.records[i])
        eos = self.tokenizer.eos_token_id
        truncated = [c[-1] != eos for c in batch.completion_ids]
        samples = score_samples(records, batch.completion_ids, truncated, self.rewards, cfg, self.tokenizer)  # the stated rewards are never used
        stated = meta["rewards"]
        if not isinstance(stated, list) or len(stated) != n or any(not isinstance(s, (int, float)) or abs(float(s) - v) > 1e-6 for s, v in zip(stated, samples.rewards)):
            raise Rejected("stated rewards differ from what the trainer's verifiers give the completions (forged)")
        behaviour = batch.behaviour_logp_NC
        if not torch.isfinite(behaviour).all():
            raise Rejected("behaviour log-probs are not finite")
        self._check_logprobs(batch, records)
        lengths = [len(c) for c in batch.completion_ids]
        return Verified(batch.key, batch.worker, batch.version, samples, [behaviour[i, :l].tolist() for i, l in enumerate(lengths)])

    def _check_logprobs(self, batch: Batch, records: list[dict[str, Any]]) -> None:
        """Recompute the behaviour log-probs of `verify_rows` completions (chosen by the batch's
        key) under the stated policy version and dtype: a worker that sampled from another model or
        made its completions up is caught here."""
        cfg, version, dtype = self.cfg, batch.version, batch.meta["dtype"]
        if self._verifier is None or self._verifier[:2] != (version, dtype):
            if self._weights is None:
                self._weights = self.make_model().eval()
            model = self._weights.float()
            try:
                load_version(self.run, self.path, version, model)
            except NotFound:
                raise Rejected(f"policy version {version} does not exist (any more): it cannot be checked") from None
            self._verifier = (version, dtype, sampler(model, dtype) if dtype == "int8" else copy_as(model, dtype))
        model = self._verifier[2]
        rng = random.Random(batch.key)
        rows = sorted(rng.sample(range(len(batch.completion_ids)), min(cfg.verify_rows, len(batch.completion_ids))))
        group = cfg.group_size
        recs = [records[r // group] for r in rows]
        comps = [batch.completion_ids[r] for r in rows]
        ids, attention, p, cmask = pack(recs, comps, 1, self.tokenizer.pad_token_id, torch.device("cpu"))
        with torch.inference_mode():
            mine = logprobs_in_chunks(model, ids, attention, p, cfg.temperature, len(rows)).float()
        stated = batch.behaviour_logp_NC[rows, : mine.shape[1]]
        diff = float(((mine - stated).abs() * cmask).sum() / cmask.sum().clamp_min(1))
        if not diff <= cfg.verify_tolerance:
            raise Rejected(f"behaviour log-probs differ from policy version {version} ({dtype}) by {diff:.3f} nats per token (tolerance {cfg.verify_tolerance}): sampled from another model, or made up")


class AsyncGRPOStep(GRPOStep):
    """The `--rollouts store` step: grad_accum verified batches from rollout workers (policy at
    most max_async versions old), the ratio taken against their behaviour log-probs with the
    mismatched tokens masked; with none usable within rollout_wait seconds it samples them itself."""

    def __init__(self, cfg: Any, source: StoreRollouts, ref_model: torch.nn.Module | None = None, dataset: str = "?"):
        super().__init__(cfg, source.records, source.rewards, source.tokenizer, ref_model, dataset)
        self.source = source
        self.checkpoint_multiple = 1

    def __call__(self, model: torch.nn.Module, acc: Any, it: Any) -> dict[str, float]:
        if self.ref_model is not None and not self.ref_ready:
            self.ref_model, self.ref_ready = acc.prepare_model(self.ref_model, evaluation_mode=True), True
        cfg, src = self.cfg, self.source
        t0 = time.perf_counter()
        got, stats = src.take(cfg.grad_accum, cfg.rollout_wait)
        own = cfg.grad_accum - len(got)
        parts, behaviour, versions = [v.samples for v in got], [row for v in got for row in v.behaviour_logp], [v.version for v in got]
        if own:  # no worker kept up: sample the rest here, from the current policy (its own log-probs are the behaviour's)
            policy = acc.unwrap_model(model)
            for k in range(own):
                picked = pick_prompts(f"trainer-{src.path}", src.steps * cfg.grad_accum + k, cfg.batch_size, len(src.records))
                samples = self._sample([src.records[i] for i in picked], policy)
                parts.append(samples)
                behaviour += [None] * len(samples.completion_ids)
                versions.append(src.steps)
        external = src.take_external(cfg.external) if cfg.external else None
        if external is not None:  # SAPO: other paths' experience, weighted as this path's own samples
            parts.append(external)
            behaviour += [None] * len(external.completion_ids)
            stats["external_groups"] = float(len(external.records))
            stats["external_reward"] = sum(external.rewards) / len(external.rewards)
        elif cfg.external:
            stats["external_groups"] = 0.0
        samples = Samples.concat(parts)
        ro = to_rollout(samples, model, self.ref_model, cfg, self.tokenizer, time.perf_counter() - t0, {
            **stats, "store_batches": float(len(got)), "own_batches": float(own), "policy_lag": float(sum(src.steps - v for v in versions) / len(versions))})
        ro.behaviour_logp_NC = self._behaviour(ro, behaviour, model)
        src.steps += 1
        rows = cfg.batch_size * cfg.group_size
        return grpo_backward(model, acc, ro, cfg, [slice(i, i + rows) for i in range(0, len(ro.advantages_N), rows)])

    def _sample(self, records: list[dict[str, Any]], policy: torch.nn.Module) -> Samples:
        from paths.work.grpo import sample_and_score

        return sample_and_score(policy, records, self.rewards, self.cfg, self.tokenizer)

    def _behaviour(self, ro: Any, rows: list[list[float] | None], model: torch.nn.Module) -> torch.Tensor:
        """(N, C) behaviour log-probs: the workers' where they sampled, the trainer's own where it did."""
        out = torch.zeros_like(ro.completion_mask_NC, dtype=torch.float32)
        if any(r is None for r in rows):
            with torch.no_grad():
                own = logprobs_in_chunks(model, ro.ids_NT, ro.attention_NT, ro.prompt_len, self.cfg.temperature, self.cfg.batch_size * self.cfg.group_size).float()
        for i, r in enumerate(rows):
            if r is None:
                out[i] = own[i]
            else:
                out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
        return out.to(ro.completion_mask_NC.device)


class PolicyPublisher(Callback):
    """Publishes the trainer's weights as policy version <step> when it starts and after every
    optimizer step, and prunes every version but the last max_async + 1 and those a trainer
    resumed from the last checkpoint may need (its step minus max_async, up to it)."""

    def __init__(self, run: Run, path: str, max_async: int, source: StoreRollouts | None = None, needs: int = 1):
        self.run, self.path, self.max_async, self.source, self.needs = run, path, max_async, source, needs
        self.checkpointed = 0
        if source is not None:
            source.on_starving = self.starving

    def starving(self) -> None:
        """latest.json again with pending 0: the trainer waits, the workers may sample."""
        head = latest(self.run, self.path)
        if head is not None:
            self.run.store.write(f"{self.run.policy(self.path)}/latest.json", json.dumps({**head, "pending": 0, "at": time.time()}, sort_keys=True).encode())

    def _publish(self, trainer: Any) -> None:
        pending = self.source.pending if self.source is not None else 0  # workers hold back while this many are waiting
        publish(self.run, self.path, trainer.step, trainer.unwrapped, max_async=self.max_async, step=trainer.step, pending=pending, needs=self.needs)

    def started(self, trainer: Any) -> None:
        self.checkpointed = trainer.step
        if version_record(self.run, self.path, trainer.step) is None or (latest(self.run, self.path) or {}).get("version") != trainer.step:
            self._publish(trainer)

    def stepped(self, trainer: Any, record: dict[str, Any]) -> None:
        self._publish(trainer)
        k, step, ckpt = self.max_async, trainer.step, self.checkpointed
        prune(self.run, self.path, lambda v: v >= step - k or ckpt - k <= v <= ckpt)  # what this trainer, or one resumed from its checkpoint, may still check

    def committed(self, trainer: Any, step: int) -> None:
        self.checkpointed = step
