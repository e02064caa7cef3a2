"""SAPO's shared experience: prompt groups from other paths' rollout batches, re-scored here.

Only signed batches of admitted workers are read (all of an open run's), at most `rollout_reads`
objects a step, each group used once. Their prompt text and answer come from that path's own
shard, their completions are decoded and re-tokenized, and this trainer's verifiers score them:
nothing a batch states is used. They are not seed-checked (another path's policy drew them: they
are off-policy text here by design), so an admitted worker could choose them; turn `--external`
off where that matters.
"""

from __future__ import annotations

from typing import Any

from paths.errors import PathsError
from paths.work.grpo import Samples, score_samples
from paths.work.rollouts.batch import Rejected, batch_bytes_limit, decode, parse_key, prompt_sha


def take_external(src: Any, groups: int) -> Samples | None:
    """`groups` prompt groups from other paths' batches of `src.run` (a StoreRollouts), in key
    order; None when no other path has written any yet."""
    cfg, tok = src.cfg, src.tokenizer
    records, completions = [], []
    listing = [o for o in src.run.store.list("rollouts") if parse_key(o.key) and o.key.split("/")[1] != src.path]
    src.external = {k: v for k, v in src.external.items() if k in {o.key for o in listing}}  # what is gone is forgotten
    reads = cfg.rollout_reads or (cfg.max_async + 1) * cfg.grad_accum + cfg.max_rejections
    for o in listing:
        if len(records) >= groups or reads <= 0:
            break
        who = src.identity(o.key.split("/")[3])
        used = src.external.get(o.key, 0)
        if used < 0 or who is None or who[0] == "revoked" or who[0] in src.ignored or o.size > batch_bytes_limit(cfg) * 4:
            continue  # every group of it taken, nobody admitted wrote it, or too large to be a batch
        reads -= 1
        try:
            batch = decode(src.run.store.read(o.key), o.key, batch_bytes_limit(cfg) * 4, who[1])
            mine = _records_of(src, o.key.split("/")[1], batch.meta["dataset"])
        except (Rejected, PathsError):
            src.external[o.key] = -1
            continue  # not readable, or a path whose prompts this trainer cannot read: not shared experience
        if batch.model_masks is not None:
            src.external[o.key] = -1
            continue  # episodes: only their environment can score them
        g, index, shas = batch.meta["group_size"], batch.meta["prompt_index"], batch.meta["prompt_sha256"]
        while used < len(index) and len(records) < groups:
            i = index[used]
            rows = batch.completion_ids[used * g : used * g + cfg.group_size]
            if 0 <= i < len(mine) and prompt_sha(mine[i]) == shas[used] and g >= cfg.group_size and len(rows) == cfg.group_size:
                theirs = mine[i]
                ids = tok(theirs["prompt"], add_special_tokens=False)["input_ids"] if "ids" not in theirs else theirs["ids"]
                records.append({**theirs, "ids": ids})
                for text, original in zip(tok.batch_decode(rows, skip_special_tokens=True), rows):
                    again = tok(text, add_special_tokens=False)["input_ids"][: cfg.max_new_tokens - 1]
                    completions.append(again + ([tok.eos_token_id] if original[-1] == tok.eos_token_id or not again else []))
            used += 1
        src.external[o.key] = -1 if used >= len(index) else used
    if not records:
        return None
    truncated = [c[-1] != tok.eos_token_id for c in completions]
    return score_samples(records, completions, truncated, src.rewards, cfg, tok)


def _records_of(src: Any, path: str, dataset: str) -> list[dict[str, Any]]:
    """Another path's training prompts (cached on the source)."""
    from paths.units import data_id
    from sharding.dataset import dataset_manifest, read_prompts

    key = f"{dataset}/{path}"
    if key not in src.other_records:
        src.other_records[key] = read_prompts(src.run, dataset, data_id(src.run, path, dataset_manifest(src.run, dataset)), "train")
    return src.other_records[key]
