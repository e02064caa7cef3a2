"""The rollout worker (`paths rollout`): sample batches from the newest policy version and write them.

Each batch is drawn from seeds the worker cannot choose (seeds.py): its prompts and every
completion token follow from the version's nonce, the worker's name and key, and the batch's
position in the worker's chain. A batch names (signed) the digest of the one before it, and the
trainer takes the chain in order, so a worker cannot sample many positions and keep the best, nor
skip one by writing something else in its place. Batches are signed with the worker's Ed25519
key and written with a create-only put; the object's number is only a name (the next free one).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any, Callable

import torch

from paths.errors import ConfigurationError, DataError, NotFound, PreconditionFailed
from paths.threads import Threads
from paths.work.grpo import logprobs_in_chunks, pack, pad_rows, score_samples
from paths.work.rewards import Reward
from paths.work.rollouts.batch import DTYPES, Rejected, batch_key, decode, digest_of, encode, parse_key, prompt_sha
from paths.work.rollouts.keys import public_hex, read_allowlist
from paths.work.rollouts.policy import PolicyReader, copy_as, latest
from paths.work.rollouts.poll import Pace, Poll
from paths.work.rollouts.seeds import batch_seed, pick_prompts, row_uniforms, run_id
from paths.work.mixture import Mixture
from paths.work.sampling import complete
from storage.layout import Run

POLL = 0.2  # seconds between reads of latest.json while waiting, at most


def identity(run: Run, key: Any, name: str | None) -> tuple[str, str]:
    """(worker name, public key hex or "") this worker writes as: the name its key was admitted
    under; without a key, only in a run its owner opened (`paths keys open`)."""
    from paths.work.claims import default_worker

    allow = read_allowlist(run)
    where = run.store.url_of(run.allowlist())
    if key is None:
        if not allow.open:
            raise ConfigurationError(f"{run.url} takes signed rollout batches only ({where}): create a key with `paths keys new` and have the run's owner admit it "
                                     "(`paths keys admit RUN --name NAME --key PUBLIC`), or the owner opens the run to unsigned batches (`paths keys open RUN`)")
        return name or default_worker(), ""
    public = public_hex(key)
    admitted = allow.by_key(public)
    if admitted is not None and not admitted.active:
        raise ConfigurationError(f"worker key {public[:16]}... ({admitted.name}) was revoked from {run.url}: its batches are not read any more")
    if admitted is None:
        if not allow.open:
            raise ConfigurationError(f"worker key {public[:16]}... is not admitted to {run.url}: the run's owner admits it with "
                                     f"`paths keys admit {run.url} --name NAME --key {public}`")
        return name or default_worker(), public
    if name is not None and name != admitted.name:
        raise ConfigurationError(f"worker key {public[:16]}... is admitted as {admitted.name!r}, not {name!r}: drop --worker, or pass --worker {admitted.name}")
    return admitted.name, public


def next_index(run: Run, path: str, worker: str) -> int:
    """The object number after the highest one under this worker's folder."""
    done = [where[1] for o in run.store.list(f"{run.rollouts(path)}/batches/{worker}") if (where := parse_key(o.key))]
    return max(done) + 1 if done else 0


def chain_head(run: Run, path: str, worker: str, public: str, looks: int = 64) -> tuple[int, str]:
    """(next position, digest of the last batch) of this worker's chain, from its own newest
    batch in its folder (objects it did not sign are passed over, at most `looks` of them)."""
    keys = sorted((where[1], o.key) for o in run.store.list(f"{run.rollouts(path)}/batches/{worker}") if (where := parse_key(o.key)))
    for _, key in reversed(keys[-looks:]):
        try:
            batch = decode(run.store.read(key), key, 1 << 40, public or None)
        except (Rejected, NotFound):
            continue
        if batch.worker == worker and batch.meta["path"] == path and batch.meta["key"] == public:
            return batch.position + 1, batch.digest
    if len(keys) > looks:
        raise DataError(f"none of the newest {looks} objects in {run.store.url_of(f'{run.rollouts(path)}/batches/{worker}')} is this worker's: someone writes there; "
                        "ask the run's owner to admit this key under another name")
    return 0, ""


def holds_back(head: dict[str, Any], worker: str, numbers: list[int], since: int, max_async: int) -> bool:
    """Whether enough batches wait for the trainer that one sampled now from `head`'s version would
    come too late. A new batch queues behind the `pending` ones the trainer counted as it published
    `head` and this worker's own that it did not count: the object `numbers` above the highest it
    listed in the worker's folder (`heard`), or, from a trainer that does not say, the `since`
    written after `head` was first seen. The batch k places back is taken k // needs steps on:
    usable while that is at most max_async. Where other workers write too, one place is left
    to them (a batch one of them is sampling is in no count: two sharing a core lost 8% without)."""
    heard, places = head.get("heard"), (int(head.get("max_async", max_async)) + 1) * max(1, int(head.get("needs", 1)))
    if isinstance(heard, dict):
        last = int(heard.get(worker, -1))
        since = sum(1 for n in numbers if n > last)
        if any(w != worker for w in heard):
            places -= 1
    else:
        places -= 1  # a trainer that does not say what it listed: the count may miss a batch of this worker's too
    return int(head.get("pending", 0)) + since >= max(1, places)


def finished(run: Run, path: str) -> bool:
    """Whether the path's claim says its training is done."""
    from paths.work.claims import read_claim

    record, _ = read_claim(run, path)
    return record is not None and record.get("state") == "done"


def _prompts(run: Run, path: str, dataset: str) -> list[dict[str, Any]]:
    """The path's training prompts (a domain expert's: its domain's shard)."""
    from paths.units import data_id
    from sharding.dataset import dataset_manifest, path_entry, read_prompts

    manifest = dataset_manifest(run, dataset)
    if manifest.get("data_kind") != "prompts":
        raise ConfigurationError(f"dataset {dataset!r} holds documents: a rollout worker needs a prompt dataset (`paths shard --kind prompts`)")
    from paths.envs.spec import check_versions

    check_versions(manifest.get("environments") or [], f"dataset {dataset!r}")
    try:
        shard = data_id(run, path, manifest)
    except NotFound:
        shard = path
    if shard not in manifest.get("paths", {}):
        raise ConfigurationError(f"path {path} has no prompt shard in dataset {dataset!r}: route prompts to it, or run the worker for another path")
    path_entry(run, dataset, shard)
    records = read_prompts(run, dataset, shard, "train")
    if not records:
        raise ConfigurationError(f"path {path} has no training prompts in dataset {dataset!r}: shard more prompts, or run the worker for another path")
    return records


def rollout_worker(run: Run, path: str, dataset: str, cfg: Any, rewards: list[Reward], *, worker: str | None = None, key: Any = None, dtype: str = "fp32",
                   batches: int = 1, wait: float = 600.0, on_batch: Callable[[dict[str, Any]], None] | None = None, episodes: Any = None) -> dict[str, Any]:
    """Write `batches` rollout batches of `path` (each: batch_size prompts x group_size completions
    drawn from its seeds with the newest policy version in `dtype`, signed with `key`), reloading
    whenever the policy moved on and dropping a batch that would arrive more than max_async
    versions late; stop early once the path's training is done. `episodes` (an EpisodeSampler):
    a multi-turn environment's dataset, each completion an episode. Returns a summary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from paths.allocator import keep_freed_memory
    from paths.models import materialize
    from paths.work.sampling import check_prompts

    if dtype not in DTYPES:
        raise ConfigurationError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if batches < 1:
        raise ConfigurationError(f"--batches must be >= 1, got {batches}")
    name, public = identity(run, key, worker)
    records = _prompts(run, path, dataset)
    hf_logging.disable_progress_bar()
    keep_freed_memory()  # a batch's KV caches and logits from the heap, not an mmap() each token (paths/allocator.py)
    local = tempfile.mkdtemp(prefix=f"paths-rollout-{path}-")
    try:
        materialize(run, path, os.path.join(local, "init"))
        policy = AutoModelForCausalLM.from_pretrained(os.path.join(local, "init"), dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(local, "init"))
        check_prompts(records, rewards, dataset, policy.config.max_position_embeddings, cfg.max_new_tokens)
        rid = run_id(run)
        loaded, model, mixture = None, None, None
        reader = PolicyReader(run, path, policy)  # policy stays fp32: deltas apply to exactly what the trainer published
        position, previous = chain_head(run, path, name, public)
        index = next_index(run, path, name)
        written, dropped, reloads, tokens, seconds = 0, 0, 0, 0, 0.0
        seen, since, numbers = None, 0, []  # batches written since the trainer last said how many wait; the object numbers of the last ones
        pace = Pace()  # when the trainer's next version is due
        threads = Threads()  # torch's threads kept to the cores other processes leave free
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
                    loaded = reader.load(int(head["version"]))
                except (NotFound, DataError):
                    time.sleep(POLL)  # pruned or being replaced meanwhile: read latest again
                    continue
                if public:
                    identity(run, key, name)  # revoked meanwhile: stop
                model, reloads = copy_as(policy, dtype), reloads + 1
                if loaded.get("mixture", "") != (mixture.text if mixture else ""):  # the trainer's ratio: its seeds draw the prompts in it
                    mixture = Mixture(records, loaded["mixture"], f"dataset {dataset!r} for path {path}") if loaded.get("mixture") else None
            said = (head["version"], head.get("at"))
            if said != seen:
                seen, since = said, 0
            pace.saw(int(head["version"]), float(head.get("at") or 0.0))
            if holds_back(head, name, numbers, since, cfg.max_async):
                waited, poll = time.time(), Poll(POLL, due=pace.due())  # short looks from when the trainer's next version is due
                while (lambda h: (h["version"], h.get("at")))(latest(run, path) or head) == said and time.time() - waited < wait and not finished(run, path):
                    poll.sleep()  # enough batches wait for the trainer: more would only go stale
                continue
            threads.check()
            t0 = time.perf_counter()
            seed = batch_seed(loaded["nonce"], name, public, position)
            picked = pick_prompts(seed, cfg.batch_size, len(records), mixture)
            recs = [records[i] for i in picked]
            samples, logp, extra = _sample(model, recs, rewards, cfg, tokenizer, row_uniforms(seed, cfg.batch_size * cfg.group_size, cfg.max_new_tokens), episodes, dtype)
            completion_ids = samples.completion_ids
            seconds += time.perf_counter() - t0
            now = latest(run, path)
            if now is not None and int(now["version"]) - int(loaded["version"]) > int(now.get("max_async", cfg.max_async)):
                dropped += 1  # it would arrive too late to be used: reload first (same position, the new version's seeds)
                continue
            meta = {"run": rid, "path": path, "dataset": dataset, "worker": name, "batch": position, "previous": previous, "policy_version": int(loaded["version"]), "policy_sha256": loaded["sha256"],
                    "nonce": loaded["nonce"], "dtype": dtype, "prompt_index": picked, "prompt_sha256": [prompt_sha(r) for r in recs], "rewards": samples.rewards,
                    "group_size": cfg.group_size, "temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens, "at": time.time(), **extra}
            data = encode(completion_ids, logp, meta, key if public else None, samples.model_masks)
            while True:
                try:
                    run.store.put_if_absent(batch_key(run, path, name, index), data)
                    break
                except PreconditionFailed:
                    index = next_index(run, path, name)  # the number is taken (by anyone): the next free one; the chain is in the batch
            written, index, since, position, previous = written + 1, index + 1, since + 1, position + 1, digest_of(data)
            numbers = [*numbers[-63:], index - 1]
            tokens += sum(len(c) for c in completion_ids)
            if on_batch is not None:
                on_batch({"batch": position - 1, "version": meta["policy_version"], "reward_mean": sum(samples.rewards) / len(samples.rewards), "tokens": tokens, "tokens_per_s": tokens / max(1e-9, seconds)})
        return {"path": path, "worker": name, "key": public, "dtype": dtype, "batches": written, "dropped_stale": dropped, "reloads": reloads, "tokens": tokens,
                "tokens_per_s": tokens / max(1e-9, seconds), "last_version": loaded["version"] if loaded else None}
    finally:
        shutil.rmtree(local, ignore_errors=True)


def _sample(model: torch.nn.Module, records: list[dict[str, Any]], rewards: list[Reward], cfg: Any, tokenizer: Any, uniforms: torch.Tensor,
            episodes: Any, dtype: str = "fp32") -> tuple[Any, torch.Tensor, dict[str, Any]]:
    """A batch's scored samples, drawn with its seeded numbers; their behaviour log-probs (N, C); and
    the metadata an episode batch adds (whether the trainer replays the environment or takes its
    recorded answers).

    The log-probs: in fp32 and int8, as sampling computed them (the KV-cached pass agrees with the
    trainer's teacher-forced one to ~1e-6, well inside the seed check's `prob`: int8 quantizes each
    token by its own scale, so batching does not move it; a second pass over the completions cost
    more than sampling them). In bf16 a teacher-forced pass, the one the seed check repeats: its
    activations round differently one token at a time (README, "Rollouts nobody has to trust")."""
    chunk = cfg.generation_batch_size or cfg.batch_size * cfg.group_size
    if episodes is not None:
        with torch.inference_mode():
            samples = episodes.samples(model, records, rewards, tokenizer, group=cfg.group_size, budget=cfg.max_new_tokens, temperature=cfg.temperature,
                                       top_p=cfg.top_p, chunk=chunk, uniforms=uniforms)
        logp = _padded(samples.logprobs)
        if episodes.deterministic:
            return samples, logp, {"environment": "replayed"}
        from paths.work.episodes import episode_keys

        return samples, logp, {"environment": "recorded", "environment_messages": [episodes.said.get(k, []) for k in episode_keys(len(records), cfg.group_size)]}
    drawn: list[list[float]] | None = [] if dtype in ("fp32", "int8") else None
    with torch.inference_mode():
        completion_ids, truncated = complete(model, records, cfg.group_size, tokenizer, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                             chunk=chunk, uniforms=uniforms, logprobs=drawn)
        if drawn is not None:
            logp = _padded(drawn)
        else:
            ids, attention, p, _ = pack(records, completion_ids, cfg.group_size, tokenizer.pad_token_id, torch.device("cpu"))
            logp = logprobs_in_chunks(model, ids, attention, p, cfg.temperature, cfg.batch_size * cfg.group_size)
    return score_samples(records, completion_ids, truncated, rewards, cfg, tokenizer), logp, {}


def _padded(rows: list[list[float]]) -> torch.Tensor:
    """Per-completion log-probs as an (N, C) float tensor, right-padded with 0."""
    return pad_rows(rows, max(1, max(map(len, rows))), "cpu", torch.float32)
