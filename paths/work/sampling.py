"""Sampling from a model and scoring what it wrote: the lean KV-cached sampler, completions of prompt
records in chunks (a group's prompt prefilled once), greedy evaluation with the rewards, and the
checks prompts pass before anyone samples them. GRPO (grpo.py) and rejection sampling
(rejection.py) use it; so does evaluation of prompt datasets (compose/evaluate.py).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from paths.errors import DataError
from paths.work.rewards import Reward, check_answers, score


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), left-padded so every completion starts at the same column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@functools.cache
def forward_arguments(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def cache_argument(model: torch.nn.Module) -> str:
    """transformers >= 5.x names the KV-cache argument `cache`; older releases `past_key_values`.
    Inspected on the model itself, not on a DDP or compile wrapper."""
    return "cache" if "cache" in forward_arguments(type(model)) else "past_key_values"


def sampling_cdf(logits_NV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """(N, V) cumulative distribution, in vocabulary order, of softmax(logits / temperature)
    restricted to the top-p nucleus (not normalised: its last column is the total). The sampler
    and the trainer's check of a worker's samples (rollouts/verify.py) both compute it here."""
    probs = torch.softmax(logits_NV.float() / temperature, -1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest set reaching top_p
        sorted_p[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs.cumsum(-1)


def inverse_cdf(cdf_NV: torch.Tensor, u_N: torch.Tensor) -> torch.Tensor:
    """The token each row's uniform number in [0, 1) picks: the first entry whose cumulative
    probability exceeds u x total (right=True never lands on a zero-probability entry)."""
    total = cdf_NV[:, -1:]
    if not bool(torch.isfinite(total).all() and (total > 0).all()):
        raise DataError("the model produced non-finite logits while sampling: lower the learning rate, or train in fp32 (--set precision=fp32)")
    return torch.searchsorted(cdf_NV, u_N.to(cdf_NV).view(-1, 1) * total, right=True).squeeze(1).clamp_(max=cdf_NV.shape[-1] - 1)


def sample_tokens(logits_NV: torch.Tensor, temperature: float, top_p: float, u_N: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), restricted to the top-p nucleus;
    temperature 0 is greedy. Inverse-CDF sampling: one uniform number per row (multinomial draws
    one per vocabulary entry, 15x slower on CPU), from torch's generator or given in `u_N` (a
    rollout worker's seeded numbers, which the trainer can check)."""
    if temperature == 0:
        return logits_NV.argmax(-1)
    u = torch.rand(len(logits_NV), device=logits_NV.device) if u_N is None else u_N
    return inverse_cdf(sampling_cdf(logits_NV, temperature, top_p), u)


DROP_SHARE = 0.25  # generate() drops finished rows from its batch once they are this share of it


@torch.inference_mode()
def generate(model: torch.nn.Module, ids_NP: torch.Tensor, mask_NP: torch.Tensor, max_new_tokens: int, temperature: float, top_p: float, eos_id: int, pad_id: int, repeats: int = 1,
             uniforms_NC: torch.Tensor | None = None, logprobs: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Sampled completions (N x repeats, C) with a KV cache: one prefill, then one token per
    forward; with a `logprobs` list, each step's (N,) log-probabilities of the sampled tokens (at
    the sampling temperature) are appended to it. A lean loop instead of `generate()`: for small models its per-token bookkeeping costs
    as much as the forward pass. With `repeats`, each prompt is prefilled once and its cache copied
    for its `repeats` completions (a GRPO group). A row that produced EOS is padded from there on;
    once finished rows are DROP_SHARE of the batch they leave it (their cache too), so the
    forwards run the unfinished rows only. A row draws with its own numbers (`uniforms_NC`), so
    which rows share its forward does not choose its tokens (beyond the last bits of rounding,
    which the trainer's seed check tolerates)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    kv = {cache_argument(model): cache}
    keep = {"logits_to_keep": 1} if "logits_to_keep" in forward_arguments(type(model)) else {}
    positions = (mask_NP.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids_NP, attention_mask=mask_NP, position_ids=positions, use_cache=True, **kv, **keep).logits[:, -1]
    if repeats > 1:
        cache.batch_repeat_interleave(repeats)
        logits, mask_NP, positions = (t.repeat_interleave(repeats, 0) for t in (logits, mask_NP, positions))
    n = len(mask_NP)
    mask = torch.cat([mask_NP, torch.ones((n, max_new_tokens), dtype=mask_NP.dtype, device=mask_NP.device)], dim=1)
    pos = positions[:, -1:]
    rows = torch.arange(n, device=ids_NP.device)  # the rows still in the batch
    done = torch.zeros(n, dtype=torch.bool, device=ids_NP.device)  # of those, the ones past EOS
    out = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=ids_NP.device)
    width = ids_NP.shape[1]
    for t in range(max_new_tokens):
        u = None if uniforms_NC is None else uniforms_NC[rows.to(uniforms_NC.device), t]
        token = torch.where(done, pad_id, sample_tokens(logits, temperature, top_p, u))
        if logprobs is not None:
            scaled = logits.float() / (temperature or 1.0)
            step = torch.zeros(n, dtype=scaled.dtype, device=scaled.device)
            logprobs.append(step.index_copy_(0, rows, scaled.gather(1, token.unsqueeze(1)).squeeze(1) - torch.logsumexp(scaled, -1)))
        out[rows, t] = token
        done |= token == eos_id
        if t + 1 == max_new_tokens or bool(done.all()):
            return out[:, : t + 1]
        if int(done.sum()) >= DROP_SHARE * len(rows):
            stay = torch.nonzero(~done).squeeze(1)
            cache.batch_select_indices(stay)
            rows, mask, pos, token, done = rows[stay], mask[stay], pos[stay], token[stay], done[stay]
        pos = pos + 1
        logits = model(input_ids=token.unsqueeze(1), attention_mask=mask[:, : width + t + 1], position_ids=pos, use_cache=True, **kv, **keep).logits[:, -1]
    return out


def record_fields(records: list[dict[str, Any]], repeat: int) -> dict[str, list[Any]]:
    """Every field of the prompt records but the token ids, each repeated for the G completions, and
    `_group`: which record each row is (a group-level scorer's groups, even when a prompt is drawn twice)."""
    names = sorted({k for r in records for k in r} - {"ids", "prompt"})
    out = {k: [r.get(k) for r in records for _ in range(repeat)] for k in names}
    out["_group"] = [i for i in range(len(records)) for _ in range(repeat)]
    return out


def complete(model: torch.nn.Module, records: list[dict[str, Any]], group: int, tokenizer: Any, *, max_new_tokens: int, temperature: float, top_p: float = 1.0, chunk: int = 64,
             uniforms: torch.Tensor | None = None, logprobs: list[list[float]] | None = None) -> tuple[list[list[int]], list[bool]]:
    """`group` sampled completions per record (greedy at temperature 0), generated `chunk` rows at
    a time: token ids up to and including EOS, and which were cut at max_new_tokens. `uniforms`
    ((records x group, max_new_tokens), optional) are the numbers each completion's tokens are
    drawn with, whatever the chunking. A `logprobs` list gets each completion's log-probabilities
    of its tokens as they were drawn (at the sampling temperature): the behaviour policy's, with no
    second pass over the completions."""
    # a chunk of whole groups prefills each prompt once; otherwise every row is its own prompt
    shared = group if chunk % group == 0 else 1
    rows = [r["ids"] for r in records for _ in range(group // shared)]
    per = chunk // shared
    device, eos, pad = device_of(model), tokenizer.eos_token_id, tokenizer.pad_token_id
    was_training = model.training
    drawn: torch.Tensor | None = None
    model.eval()
    ids_out: list[list[int]] = []
    truncated: list[bool] = []
    try:
        for i in range(0, len(rows), per):
            ids, mask = left_pad(rows[i : i + per], pad, device)
            if forward_arguments(type(model)) & {"cache", "past_key_values"}:
                u = None if uniforms is None else uniforms[i * shared : (i + per) * shared].to(device)
                steps: list[torch.Tensor] | None = [] if logprobs is not None else None
                out = generate(model, ids, mask, max_new_tokens, temperature, top_p, eos, pad, repeats=shared, uniforms_NC=u, logprobs=steps).tolist()
                drawn = torch.stack(steps, 1).float().cpu() if steps is not None else None  # (N, T)
            else:  # a model with its own decoding (the ensemble): its generate()
                if uniforms is not None or logprobs is not None:
                    raise DataError(f"{type(model).__name__} decodes with its own generate(): it cannot sample from given seeds or give its log-probs")
                ids, mask = ids.repeat_interleave(shared, 0), mask.repeat_interleave(shared, 0)
                sampled = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad, **sampled)[:, ids.shape[1]:].tolist()
            for r, seq in enumerate(out):
                n = seq.index(eos) + 1 if eos in seq else len(seq)
                ids_out.append(seq[:n])
                truncated.append(eos not in seq[:n])
                if logprobs is not None:
                    logprobs.append(drawn[r, :n].tolist())
    finally:
        model.train(was_training)
    return ids_out, truncated


def check_prompts(records: list[dict[str, Any]], rewards: list[Reward], dataset: str, context: int | None = None, max_new_tokens: int = 0) -> None:
    """Gold answers every reward can read, and prompts that fit the model's context with their
    completion."""
    check_answers(rewards, records, dataset)
    if context is not None:
        for i, r in enumerate(records):
            if len(r["ids"]) + max_new_tokens > context:
                name = r.get("id", f"record {i}")
                raise DataError(f"dataset {dataset!r}: prompt {name!r} has {len(r['ids'])} tokens, with max_new_tokens {max_new_tokens} more than the model's context of {context}: shorten it, or lower --max-new-tokens")



@torch.no_grad()
def evaluate(model: torch.nn.Module, tokenizer: Any, records: list[dict[str, Any]], rewards: list[Reward], max_new_tokens: int, batch: int = 64) -> dict[str, float]:
    """Mean of each reward (and their weighted sum) over greedy completions of the records."""
    if not records:
        return {"reward": 0.0, "prompts": 0}
    completion_ids, _ = complete(model, records, 1, tokenizer, max_new_tokens=max_new_tokens, temperature=0.0, chunk=batch)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    total, means = score(rewards, [r["prompt"] for r in records], texts, completion_ids, record_fields(records, 1))
    return {"reward": sum(total) / len(total), **means, "prompts": len(records)}
