"""GRPO with verifiable rewards, as small pieces: sample -> score -> select -> advantage -> loss.

Per rollout: take `grad_accum x batch_size` prompts, sample `group_size` completions for each with
the current policy (a lean KV-cached loop, `generation_batch_size` rows at a time), score them with
the rewards (every field of the prompt record passed along, TRL's convention), optionally punish or
mask completions cut at `max_new_tokens` (DAPO's overlong shaping), and with `dynamic_sampling`
drop groups whose rewards are all equal and sample more prompts until the batch is full (DAPO).
Rewards are normalised within each group (the advantage); the clipped surrogate is then optimised
token by token, micro-batch by micro-batch. With `iterations` > 1 the same rollout serves that many
optimizer steps against the log-probabilities it was sampled with; with `beta` > 0 a frozen copy of
the starting weights adds the k3 KL estimate. Loss normalisation follows TRL for each `loss` type.

Every tensor lives on the model's device; the log-prob passes materialise logits of the completion
only (`logits_to_keep`) and run one micro-batch at a time, so memory does not grow with grad_accum.

Shapes: N completions (prompts x G), P prompt tokens (left-padded), C completion tokens.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from paths.errors import ConfigurationError, DataError
from paths.head_loss import sharded
from paths.trainer import Callback, ranks_agree
from paths.work.mixture import source_of
from paths.work.rewards import Reward, score
from paths.work.sampling import cache_argument, complete, device_of, evaluate, forward_arguments, left_pad, record_fields

if TYPE_CHECKING:
    from paths.train_config import TrainConfig

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
Scale = Literal["group", "batch", "none"]
log = logging.getLogger("paths.grpo")


# -- advantage ---------------------------------------------------------------------------------------
def group_advantages(rewards_N: torch.Tensor, group: int, scale: Scale) -> torch.Tensor:
    """reward - its group's mean, divided by the group's std (`group`), the batch's (`batch`) or
    nothing (`none`, Dr. GRPO); a group whose rewards are all equal gets zero advantage."""
    r_GK = rewards_N.view(-1, group)  # (prompts, G)
    same = (r_GK == r_GK[:, :1]).all(1, keepdim=True)  # exactly zero there: the mean of equal rewards can be an ulp off them (8 x 1.2)
    centred = torch.where(same, 0.0, r_GK - r_GK.mean(1, keepdim=True)).view(-1)
    if scale == "group":
        return centred / (r_GK.std(1, keepdim=True).expand_as(r_GK).reshape(-1) + 1e-4)
    if scale == "batch":
        return centred / (rewards_N.std() + 1e-4)
    return centred


def overlong_penalty(lengths: list[int], max_new_tokens: int, buffer: int) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens - buffer tokens, then linearly down
    to -1 at max_new_tokens."""
    start = max_new_tokens - buffer
    return [min(0.0, (start - n) / buffer) if buffer > 0 else 0.0 for n in lengths]


# -- loss pieces ---------------------------------------------------------------------------------------
def clipped_surrogate(logp_NC: torch.Tensor, old_NC: torch.Tensor, adv_N: torch.Tensor, eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A), and where clipping is active."""
    rho = torch.exp(logp_NC - old_NC)
    a = adv_N.unsqueeze(1)  # (N, 1)
    unclipped, clipped = rho * a, torch.clamp(rho, 1 - eps_low, 1 + eps_high) * a
    return -torch.min(unclipped, clipped), (clipped < unclipped)


def mismatch_keep(train_NC: torch.Tensor, behaviour_NC: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """1 for the tokens whose trainer and sampler probabilities agree, 0 for those masked out of
    the loss: `icepop` masks a ratio p_train / p_sampler outside [mismatch_low, mismatch_high],
    `ipo` (prime-rl) an absolute difference |p_train - p_sampler| above mismatch_delta."""
    if cfg.mismatch == "none":
        return torch.ones_like(train_NC)
    if cfg.mismatch == "icepop":
        ratio = torch.exp(train_NC - behaviour_NC)
        return ((ratio >= cfg.mismatch_low) & (ratio <= cfg.mismatch_high)).float()
    return ((torch.exp(train_NC) - torch.exp(behaviour_NC)).abs() <= cfg.mismatch_delta).float()


def kl_k3(logp_NC: torch.Tensor, ref_NC: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(ref - logp) - (ref - logp) - 1."""
    d = ref_NC - logp_NC
    return torch.exp(d) - d - 1


def reduce_loss(per_token_NC: torch.Tensor, mask_NC: torch.Tensor, loss: LossType, step_completions: int, step_tokens: float, max_new_tokens: int, micro_batches: int = 1) -> torch.Tensor:
    """This micro-batch's share of the step's loss, normalised as TRL defines each type:
    grpo: mean over the step's sequences of each sequence's token mean; bnpo: this micro-batch's
    token mean, divided by the number of micro-batches; dapo: sum over the step's tokens / their
    number; dr_grpo: sum / (completions x max_new_tokens)."""
    masked = per_token_NC * mask_NC
    if loss == "grpo":
        return (masked.sum(1) / mask_NC.sum(1).clamp(min=1)).sum() / step_completions
    if loss == "bnpo":
        return masked.sum() / mask_NC.sum().clamp(min=1) / micro_batches
    if loss == "dapo":
        return masked.sum() / max(1, step_tokens)
    if loss == "dr_grpo":
        return masked.sum() / (step_completions * max_new_tokens)
    raise ConfigurationError(f"unknown --loss {loss!r}: use grpo, bnpo, dr_grpo or dapo")


# -- sampling and scoring ----------------------------------------------------------------------------
@dataclass(slots=True)
class Samples:
    """Scored completions of some prompts, G per prompt, before packing into tensors."""

    records: list[dict[str, Any]]  # one per group
    completion_ids: list[list[int]]  # per completion, up to and including EOS
    truncated: list[bool]  # no EOS within max_new_tokens
    texts: list[str]
    rewards: list[float]  # weighted sum of the rewards (plus the overlong penalty)
    reward_means: dict[str, float]
    model_masks: list[list[int]] | None = None  # episodes: 1 where the model sampled the token, 0 for the environment's (context only)
    logprobs: list[list[float]] | None = None  # episodes: the sampler's log-prob of each token (0 for the environment's)

    def group_signal(self, group: int, masked_truncated: bool = False) -> list[bool]:
        """Per group: do its rewards differ, and (when cut completions leave the loss) does any of
        its completions count in the loss? Is there anything to learn from it?"""
        return [len(set(self.rewards[i : i + group])) > 1 and not (masked_truncated and all(self.truncated[i : i + group]))
                for i in range(0, len(self.rewards), group)]

    def select(self, groups: list[int], group: int) -> "Samples":
        rows = [g * group + k for g in groups for k in range(group)]
        pick = lambda xs: None if xs is None else [xs[i] for i in rows]  # noqa: E731
        return Samples([self.records[g] for g in groups], pick(self.completion_ids), pick(self.truncated), pick(self.texts), pick(self.rewards), self.reward_means,
                       pick(self.model_masks), pick(self.logprobs))

    @staticmethod
    def concat(parts: list["Samples"]) -> "Samples":
        means: dict[str, list[float]] = {}
        for p in parts:
            for k, v in p.reward_means.items():
                means.setdefault(k, []).append(v)
        def joined(name: str, fill: float) -> list[list[Any]] | None:  # episodes beside single completions: those are all the model's
            if all(getattr(p, name) is None for p in parts):
                return None
            return [x for p in parts for x in (getattr(p, name) or [[fill] * len(c) for c in p.completion_ids])]

        return Samples([r for p in parts for r in p.records], [c for p in parts for c in p.completion_ids], [t for p in parts for t in p.truncated],
                       [t for p in parts for t in p.texts], [r for p in parts for r in p.rewards], {k: sum(v) / len(v) for k, v in means.items()},
                       joined("model_masks", 1), joined("logprobs", 0.0))


def sample_and_score(model: torch.nn.Module, records: list[dict[str, Any]], rewards: list[Reward], cfg: TrainConfig, tokenizer: Any) -> Samples:
    """Sample G completions per record and score them (rewards + overlong shaping)."""
    completion_ids, truncated = complete(model, records, cfg.group_size, tokenizer, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                         chunk=cfg.generation_batch_size or cfg.batch_size * cfg.group_size)
    return score_samples(records, completion_ids, truncated, rewards, cfg, tokenizer)


def score_samples(records: list[dict[str, Any]], completion_ids: list[list[int]], truncated: list[bool], rewards: list[Reward], cfg: TrainConfig, tokenizer: Any) -> Samples:
    """Score G completions per record from their token ids (decoded here): the rewards, plus the
    overlong shaping."""
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    prompts = [r["prompt"] for r in records for _ in range(cfg.group_size)]
    values, means = score(rewards, prompts, texts, completion_ids, record_fields(records, cfg.group_size))
    if cfg.overlong == "soft":
        penalty = overlong_penalty([len(c) for c in completion_ids], cfg.max_new_tokens, cfg.overlong_buffer)
        values = [v + p for v, p in zip(values, penalty)]
        means["overlong_penalty"] = sum(penalty) / len(penalty)
    means.update(source_means(records, cfg.group_size, values, completion_ids, truncated))
    return Samples(records, completion_ids, truncated, texts, values, means)


def source_means(records: list[dict[str, Any]], group: int, values: list[float], completion_ids: list[list[int]], truncated: list[bool]) -> dict[str, float]:
    """A mixture's metrics per source (the environment each prompt came from): reward, length, truncation."""
    sources = [source_of(r) for r in records for _ in range(group)]
    if len(set(sources)) < 2:
        return {}
    out = {}
    for source in sorted(set(sources)):
        rows = [i for i, s in enumerate(sources) if s == source]
        out[f"source/{source}/reward"] = sum(values[i] for i in rows) / len(rows)
        out[f"source/{source}/length"] = sum(len(completion_ids[i]) for i in rows) / len(rows)
        out[f"source/{source}/truncated"] = sum(truncated[i] for i in rows) / len(rows)
        out[f"source/{source}/share"] = len(rows) / len(sources)
    return out


# -- rollouts ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class Rollout:
    """One rollout's completions as tensors: ids, masks, rewards, advantages, sampling log-probs."""

    ids_NT: torch.Tensor  # prompt (left-padded) + completion
    attention_NT: torch.Tensor
    prompt_len: int
    completion_mask_NC: torch.Tensor  # real completion tokens (up to EOS, included)
    loss_mask_NC: torch.Tensor  # the tokens that count in the loss (overlong=mask drops cut completions)
    advantages_N: torch.Tensor
    rewards_N: torch.Tensor
    old_logp_NC: torch.Tensor | None
    ref_logp_NC: torch.Tensor | None
    reward_means: dict[str, float]
    completions: list[str]
    truncated_N: torch.Tensor
    seconds: float
    stats: dict[str, float]  # sampling statistics (dropped groups, rounds)
    behaviour_logp_NC: torch.Tensor | None = None  # asynchronous: the log-probs the rollout worker sampled with (NaN: the current policy's)


def pack(records: list[dict[str, Any]], completion_ids: list[list[int]], group: int, pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """(prompt + completion ids, attention, P, completion mask): prompts left-padded to one width,
    completions right-padded."""
    prompt, pmask = left_pad([r["ids"] for r in records for _ in range(group)], pad_id)
    width = max(len(c) for c in completion_ids)
    comp = torch.full((len(completion_ids), width), pad_id, dtype=torch.long)
    cmask = torch.zeros((len(completion_ids), width), dtype=torch.long)
    for i, c in enumerate(completion_ids):
        comp[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        cmask[i, : len(c)] = 1
    return torch.cat([prompt, comp], 1).to(device), torch.cat([pmask, cmask], 1).to(device), prompt.shape[1], cmask.to(device)


def pad_rows(rows: list[list[Any]], width: int, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Per-completion lists (0/1 masks, log-probs) as an (N, width) tensor, right-padded with 0."""
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out.to(device)


def completion_logits(model: torch.nn.Module, ids_NT: torch.Tensor, attention_NT: torch.Tensor, prompt_len: int, share_prompts: bool = False) -> torch.Tensor:
    """(N, C, V) float logits predicting each completion token, teacher-forced; only the
    completion's logits are materialised. With `share_prompts`, rows with the same prompt (a GRPO
    group) run it once (shared_prompt_logits) where the model allows it."""
    c = ids_NT.shape[1] - prompt_len
    if share_prompts and (shared := shared_prompt_logits(model, ids_NT, attention_NT, prompt_len)) is not None:
        return shared
    positions = (attention_NT.cumsum(1) - 1).clamp(min=0)
    core = getattr(model, "module", model)  # DDP keeps the model in .module
    keep = {"logits_to_keep": c + 1} if "logits_to_keep" in forward_arguments(type(core)) else {}
    logits = model(input_ids=ids_NT, attention_mask=attention_NT, position_ids=positions, **keep).logits
    return logits[:, -(c + 1) : -1].float()


def shared_prompt_logits(model: torch.nn.Module, ids_NT: torch.Tensor, attention_NT: torch.Tensor, prompt_len: int) -> torch.Tensor | None:
    """completion_logits with each distinct prompt computed once (the prefix sharing of Prefix
    Grouper): a pass over the distinct prompts fills a KV cache and gives the logits of each
    completion's first token; the cache is gathered to the rows (index_select: the gradients of
    every row that reads a prompt flow back into its one pass) and a second pass runs the
    completions on it. The same function as one pass over every row (a test holds logits and
    gradients equal), for prompt x (group - 1) fewer positions through every layer. None where it
    cannot hold: the rows' prompts are all different, the model takes no KV cache or
    `logits_to_keep` (it is wrapped by DDP or FSDP, or decodes on its own), its rotary scaling
    depends on the longest position a pass sees (dynamic, longrope), or a layer's cache did not
    fill (gradient checkpointing turns the cache off)."""
    from transformers import DynamicCache

    inner = model.get_base_model() if hasattr(model, "peft_config") else model  # peft passes the model's arguments through to it
    takes = forward_arguments(type(inner))
    if hasattr(model, "module") or sharded(model) or "logits_to_keep" not in takes or not takes & {"cache", "past_key_values"}:
        return None
    rope = getattr(inner.config, "rope_parameters", None) or getattr(inner.config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"):  # their frequencies follow the longest position a forward sees
        return None
    prompts, row_prompt = distinct_prompts(ids_NT, attention_NT, prompt_len)
    if len(prompts) == len(ids_NT):
        return None
    p_ids, p_att = prompts.clamp(min=0), (prompts >= 0).long()  # padding reads token 0: masked, it changes nothing
    p_pos = (p_att.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache()
    kv = {cache_argument(inner): cache}
    head = model(input_ids=p_ids, attention_mask=p_att, position_ids=p_pos, use_cache=True, logits_to_keep=1, **kv).logits
    layers = getattr(cache, "layers", None)  # older transformers keep no layer objects: the cache's own length then
    filled = [layer.get_seq_length() for layer in layers] if layers is not None else [cache.get_seq_length()]
    if set(filled) != {prompt_len} or (layers is not None and len(layers) != getattr(inner.config, "num_hidden_layers", len(layers))):
        return None
    c = ids_NT.shape[1] - prompt_len
    if c == 1:
        return head[row_prompt].float()
    cache.reorder_cache(row_prompt)
    positions = p_att.sum(1, keepdim=True)[row_prompt] + torch.arange(c - 1, device=ids_NT.device)  # right padding's positions are never read
    rest = model(input_ids=ids_NT[:, prompt_len:-1], attention_mask=attention_NT[:, :-1], position_ids=positions, use_cache=True, logits_to_keep=c - 1, **kv).logits
    return torch.cat([head[row_prompt], rest], 1).float()


def distinct_prompts(ids_NT: torch.Tensor, attention_NT: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each distinct prompt, its left padding as -1; which of them each row reads)."""
    return torch.unique(torch.where(attention_NT[:, :prompt_len].bool(), ids_NT[:, :prompt_len], -1), dim=0, return_inverse=True)


def completion_logprobs(model: torch.nn.Module, ids_NT: torch.Tensor, attention_NT: torch.Tensor, prompt_len: int, temperature: float, entropy: bool = False,
                        share_prompts: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log pi(token) of each completion token, (N, C), at the sampling temperature (and, with
    `entropy`, each position's entropy). Only the completion's logits are materialised; with
    `share_prompts`, each distinct prompt is computed once (shared_prompt_logits)."""
    logits = completion_logits(model, ids_NT, attention_NT, prompt_len, share_prompts) / temperature
    lse = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, ids_NT[:, prompt_len:].unsqueeze(-1)).squeeze(-1) - lse
    if not entropy:
        return logp
    with torch.no_grad():
        ent = lse - (torch.softmax(logits, -1) * logits).sum(-1)
    return logp, ent


@torch.no_grad()
def logprobs_in_chunks(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, p: int, temperature: float, rows: int, share_prompts: bool = False) -> torch.Tensor:
    return torch.cat([completion_logprobs(model, ids[i : i + rows], attention[i : i + rows], p, temperature, share_prompts=share_prompts) for i in range(0, len(ids), rows)])


def to_rollout(samples: Samples, model: torch.nn.Module, ref_model: torch.nn.Module | None, cfg: TrainConfig, tokenizer: Any, seconds: float, stats: dict[str, float] | None = None,
               ranks: int = 1) -> Rollout:
    """Pack scored samples into tensors; advantages; old / reference log-probs when needed (the old
    ones as the steps of `ranks` processes plan their micro-batches)."""
    device = device_of(model)
    ids, attention, p, cmask = pack(samples.records, samples.completion_ids, cfg.group_size, tokenizer.pad_token_id, device)
    rewards = torch.tensor(samples.rewards, dtype=torch.float32, device=device)
    truncated = torch.tensor(samples.truncated, dtype=torch.bool, device=device)
    loss_mask = cmask * (~truncated).long().unsqueeze(1) if cfg.overlong == "mask" else cmask
    if samples.model_masks is not None:  # an episode's environment tokens are context: out of the loss
        loss_mask = loss_mask * pad_rows(samples.model_masks, cmask.shape[1], device)
    ref = logprobs_in_chunks(ref_model, ids, attention, p, cfg.temperature, cfg.batch_size * cfg.group_size, cfg.share_prompts) if ref_model is not None else None
    ro = Rollout(ids, attention, p, cmask, loss_mask, group_advantages(rewards, cfg.group_size, cfg.scale_rewards), rewards, None, ref,
                 samples.reward_means, samples.texts, truncated, seconds, stats or {})
    if cfg.iterations > 1:  # the ratio's denominator for the iterations to come: only the rows their steps compute
        ro.old_logp_NC = planned_logprobs(model, ro, cfg, ranks)
    return ro


@torch.no_grad()
def planned_logprobs(model: torch.nn.Module, ro: Rollout, cfg: TrainConfig, ranks: int = 1) -> torch.Tensor:
    """(N, C) log-probs of the rows a step computes, in the step's own micro-batches
    (plan_micro_batches, each trimmed to its width); 0 in the others, whose zero advantage keeps
    them out of the loss."""
    out = torch.zeros(ro.completion_mask_NC.shape, dtype=torch.float32, device=ro.ids_NT.device)
    for picked in plan_micro_batches(ro, cfg, micro_slices(ro, cfg), ranks):
        picked = picked.to(ro.ids_NT.device)
        ids, attention, p, c = trimmed(ro, picked)
        out[picked, :c] = completion_logprobs(model, ids, attention, p, cfg.temperature, share_prompts=cfg.share_prompts)
    return out


def rollout(model: torch.nn.Module, ref_model: torch.nn.Module | None, records: list[dict[str, Any]], rewards: list[Reward], cfg: TrainConfig, tokenizer: Any) -> Rollout:
    """Sample, score and pack the completions of `records` (no dynamic sampling)."""
    t0 = time.perf_counter()
    samples = sample_and_score(model, records, rewards, cfg, tokenizer)
    return to_rollout(samples, model, ref_model, cfg, tokenizer, time.perf_counter() - t0)


# -- one optimizer step -----------------------------------------------------------------------------
def micro_slices(ro: Rollout, cfg: TrainConfig) -> list[slice]:
    """A step's micro-batches as sampled: `batch_size x group_size` rows each (plan_micro_batches'
    row cap, and what bnpo normalises by)."""
    rows = cfg.batch_size * cfg.group_size
    return [slice(i, i + rows) for i in range(0, len(ro.advantages_N), rows)]


MICRO_BATCH_COST = 256  # a micro-batch's fixed cost (launches, per-op overhead) in padded tokens, for plan_micro_batches


def plan_micro_batches(ro: Rollout, cfg: TrainConfig, micro_rows: list[slice], ranks: int = 1) -> list[torch.Tensor]:
    """The rows each micro-batch computes, as index tensors; the same loss and gradients as
    `micro_rows`, with less work. A row with zero advantage adds nothing to the loss or its
    gradient (no KL term): it is left out, and so is a row with no token in the loss. The rest
    are sorted by length and cut where padding (and, with `share_prompts`, a prompt computed again
    in another micro-batch) costs more than another micro-batch (never more rows than the largest
    of `micro_rows`), and each is trimmed to its own width in grpo_backward. bnpo (normalised per
    micro-batch) and a KL term keep `micro_rows` as they are; with several ranks each keeps its
    count of micro-batches (DDP and FSDP run theirs in step), at least one row in each."""
    every = [torch.arange(r.start or 0, min(r.stop, len(ro.advantages_N))) for r in micro_rows]  # on the CPU, as is all the planning
    if cfg.loss == "bnpo" or (cfg.beta > 0 and ro.ref_logp_NC is not None):
        return every
    completion = ro.completion_mask_NC.sum(1).cpu()
    prompt = ro.attention_NT[:, : ro.prompt_len].sum(1).cpu()
    live = ((ro.advantages_N != 0) & (ro.loss_mask_NC.sum(1) > 0)).cpu()
    if ranks > 1:
        return [rows[live[rows]] if live[rows].any() else rows[:1] for rows in every]
    order = torch.nonzero(live).flatten()
    if len(order) == 0:  # nothing to learn: one row keeps the step's backward (and its zero gradients)
        return [every[0][:1]]
    order = order[torch.argsort(completion[order], stable=True)].tolist()
    c_len, p_len = completion[order].tolist(), prompt[order].tolist()
    if cfg.share_prompts:  # each distinct prompt of a micro-batch runs once (shared_prompt_logits)
        key = distinct_prompts(ro.ids_NT, ro.attention_NT, ro.prompt_len)[1].cpu()[order].tolist()
    else:
        key = list(range(len(order)))  # every row its own prompt
    cap = max(len(r) for r in every)
    n = len(order)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)  # best[j]: cheapest plan of the j shortest rows; cut[j]: where its last micro-batch starts
    for j in range(1, n + 1):
        widest_c = widest_p = 0
        prompts: set[int] = set()
        for i in range(j - 1, max(0, j - cap) - 1, -1):  # the last micro-batch is rows i..j-1, as trimmed() pads them
            widest_c, widest_p = max(widest_c, c_len[i]), max(widest_p, p_len[i])
            prompts.add(key[i])
            cost = best[i] + MICRO_BATCH_COST + len(prompts) * widest_p + (j - i) * widest_c
            if cost < best[j]:
                best[j], cut[j] = cost, i
    plan, j = [], n
    while j:
        plan.append(torch.tensor(order[cut[j] : j]))
        j = cut[j]
    return plan[::-1]


def trimmed(ro: Rollout, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(ids, attention, prompt width, completion width) of `rows`, without the columns that are
    padding in every one of them (positions come from the attention mask, so nothing moves)."""
    attention = ro.attention_NT[rows]
    lead = min(ro.prompt_len, max(1, int(attention[:, : ro.prompt_len].sum(1).max())))  # the longest prompt among them (a column at least: the first logit kept)
    c = max(1, int(ro.completion_mask_NC[rows].sum(1).max()))
    cols = slice(ro.prompt_len - lead, ro.prompt_len + c)
    return ro.ids_NT[rows, cols], attention[:, cols], lead, c


def grpo_backward(model: torch.nn.Module, acc: Any, ro: Rollout, cfg: TrainConfig, micro_rows: list[slice]) -> dict[str, float]:
    """Loss and gradients of one rollout, micro-batch by micro-batch (sums to the step's loss);
    the micro-batches as plan_micro_batches cuts them from `micro_rows`. Entropy and the masked
    share are of the tokens computed (rows with signal)."""
    n = len(ro.advantages_N)
    tokens = int(ro.loss_mask_NC.sum())
    norm_tokens = tokens
    if acc.num_processes > 1:  # TRL: the step's tokens over every rank / ranks, so DDP's mean of gradients sums to the global normalisation
        norm_tokens = float(acc.reduce(torch.tensor([tokens], device=acc.device), reduction="sum").item()) / acc.num_processes
    eps_high = cfg.epsilon_high or cfg.epsilon
    plan = plan_micro_batches(ro, cfg, micro_rows, acc.num_processes)
    total, low, high, kl_sum, ent_sum, masked, computed = 0.0, 0, 0, 0.0, 0.0, 0, 0
    for i, rows in enumerate(plan):
        rows = rows.to(ro.ids_NT.device)
        ids, attention, p, c = trimmed(ro, rows)
        mask = ro.loss_mask_NC[rows, :c].float()
        computed += int(mask.sum())
        logp, ent = completion_logprobs(model, ids, attention, p, cfg.temperature, entropy=True, share_prompts=cfg.share_prompts)
        old = logp.detach() if ro.old_logp_NC is None else ro.old_logp_NC[rows, :c]
        if ro.behaviour_logp_NC is not None:  # sampled elsewhere, maybe k versions ago: the ratio is against the sampler's log-probs
            behaviour = ro.behaviour_logp_NC[rows, :c]
            behaviour = torch.where(behaviour.isnan(), logp.detach(), behaviour)  # NaN: the current policy sampled the row
            keep = mismatch_keep(logp.detach(), behaviour, cfg)
            masked += int(((1 - keep) * mask).sum())
            mask, old = mask * keep, behaviour
        adv = ro.advantages_N[rows]
        per_token, _ = clipped_surrogate(logp, old, adv, cfg.epsilon, eps_high)
        if ro.ref_logp_NC is not None and cfg.beta > 0:
            kl = kl_k3(logp, ro.ref_logp_NC[rows, :c])
            per_token = per_token + cfg.beta * kl
            kl_sum += float((kl.detach() * mask).sum())
        loss = reduce_loss(per_token, mask, cfg.loss, n, norm_tokens, cfg.max_new_tokens, len(plan))
        with acc.no_sync(model) if i < len(plan) - 1 else contextlib.nullcontext():  # DDP syncs gradients once, after the last micro-batch
            acc.backward(loss)
        total += float(loss.detach())
        with torch.no_grad():
            rho, a = torch.exp(logp.detach() - old), adv.unsqueeze(1)
            low += int((((rho < 1 - cfg.epsilon) & (a < 0)).float() * mask).sum())  # TRL's clip_ratio/low (rows left out have A = 0: never clipped)
            high += int((((rho > 1 + eps_high) & (a > 0)).float() * mask).sum())
            ent_sum += float((ent * mask).sum())
    groups = ro.rewards_N.view(-1, cfg.group_size)
    lengths = ro.completion_mask_NC.sum(1).float()
    return {
        "loss": total, "tokens": int(ro.completion_mask_NC.sum()), "reward_mean": float(ro.rewards_N.mean()), "reward_std": float(ro.rewards_N.std()) if n > 1 else 0.0,
        "zero_variance_groups": float((groups.std(1) == 0).float().mean()), "completion_length": float(lengths.mean()),
        "completion_length_min": float(lengths.min()), "completion_length_max": float(lengths.max()), "truncated": float(ro.truncated_N.float().mean()),
        "entropy": ent_sum / max(1, computed), "kl": kl_sum / max(1, tokens), "clip_fraction": (low + high) / max(1, tokens),
        "clip_low": low / max(1, tokens), "clip_high": high / max(1, tokens), "completions_per_s": n / max(1e-9, ro.seconds),
        "micro_batches": float(len(plan)), "rows_computed": float(sum(len(r) for r in plan)) / n,
        **({"mismatch_masked": masked / max(1, computed)} if ro.behaviour_logp_NC is not None else {}),
        **ro.stats, **{(k if k.startswith(("source/", "episode/")) else f"reward/{k}"): v for k, v in ro.reward_means.items()},
    }


class GRPOStep:
    """The `paths train --mode grpo` step: a rollout every `iterations` optimizer steps; with
    `dynamic_sampling`, prompts are drawn until `grad_accum x batch_size` groups have signal."""

    def __init__(self, cfg: TrainConfig, records: list[dict[str, Any]], rewards: list[Reward], tokenizer: Any, ref_model: torch.nn.Module | None = None, dataset: str = "?",
                 sampler: Any = None):
        self.cfg, self.records, self.rewards, self.tokenizer, self.ref_model, self.dataset = cfg, records, rewards, tokenizer, ref_model, dataset
        self.sample = sampler or sample_and_score  # (model, records, rewards, cfg, tokenizer) -> Samples; episodes.EpisodeSampler for multi-turn environments
        self.current: Rollout | None = None
        self.used = 0
        self.ref_ready = False
        self.rollouts = self.silent = 0  # rollouts taken, and how many had no signal at all
        self.checkpoint_multiple = cfg.iterations  # rollouts are not saved: checkpoint between them

    def __call__(self, model: torch.nn.Module, acc: Any, it: Any) -> dict[str, float]:
        if self.ref_model is not None and not self.ref_ready:  # exactly like the policy: fp32 weights on its device, under the same autocast
            self.ref_model, self.ref_ready = acc.prepare_model(self.ref_model, evaluation_mode=True), True
        if self.current is None or self.used == self.cfg.iterations:
            self.current, self.used = self.next_rollout(model, acc, it), 0
        self.used += 1
        return grpo_backward(model, acc, self.current, self.cfg, micro_slices(self.current, self.cfg))

    def next_rollout(self, model: torch.nn.Module, acc: Any, it: Any) -> Rollout:
        cfg, t0 = self.cfg, time.perf_counter()
        self.rollouts += 1
        policy = acc.unwrap_model(model)  # sampling needs no gradient sync; the autocast wrapper stays
        need = cfg.grad_accum * cfg.batch_size
        kept: list[Samples] = []
        have = drawn = rounds = silent = 0
        while True:
            records = [self.records[int(i)] for _ in range(cfg.grad_accum) for i in next(it)["index"]]
            samples = self.sample(policy, records, self.rewards, cfg, self.tokenizer)
            rounds, drawn = rounds + 1, drawn + len(records)
            if not cfg.dynamic_sampling:
                kept, have = [samples], len(records)
                break
            flags = samples.group_signal(cfg.group_size, cfg.overlong == "mask")
            signal = [g for g, s in enumerate(flags) if s]
            silent += len(flags) - len(signal)  # dropped: no signal (surplus groups with signal are not counted)
            kept.append(samples.select(signal[: need - have], cfg.group_size))
            have += len(signal[: need - have])
            if ranks_agree(acc, have >= need, "all"):
                break
            if rounds >= cfg.max_sampling_rounds:
                raise DataError(f"dynamic sampling found {have} of {need} prompt groups with signal in {rounds} rounds ({drawn} prompts) of dataset {self.dataset!r}: "
                                "raise max_sampling_rounds, use easier prompts or a larger group_size, or turn dynamic_sampling off")
        samples = Samples.concat(kept)
        stats = {"dropped_groups": float(silent), "sampling_rounds": float(rounds)}
        if not cfg.dynamic_sampling and not any(samples.group_signal(cfg.group_size, cfg.overlong == "mask")):
            self.silent += 1
            if self.silent in (1, 10) or self.silent % 100 == 0:  # the first time, then now and then
                log.warning("grpo: no group of rollout %d had reward variance (%d prompts x %d; %d such rollouts so far): those steps learn nothing; "
                            "turn on dynamic_sampling, or use prompts the model sometimes solves", self.rollouts, len(samples.records), cfg.group_size, self.silent)
        return to_rollout(samples, model, self.ref_model, cfg, self.tokenizer, time.perf_counter() - t0, stats, ranks=acc.num_processes)


class HeldoutReward(Callback):
    """Every `every` steps, the mean reward of greedy completions of held-out prompts, added to
    that step's metrics record as `heldout_reward` (and each reward's `heldout/<spec>`)."""

    def __init__(self, records: list[dict[str, Any]], rewards: list[Reward], tokenizer: Any, every: int, max_new_tokens: int, episodes: Any = None):
        self.records, self.rewards, self.tokenizer, self.every, self.max_new_tokens = records, rewards, tokenizer, every, max_new_tokens
        self.episodes = episodes  # a multi-turn environment: greedy episodes instead of single completions

    def stepped(self, trainer: Any, record: dict[str, Any]) -> None:
        if self.every and self.records and (trainer.step % self.every == 0 or trainer.step == trainer.cfg.steps):
            if self.episodes is not None:
                scores = self.episodes.evaluate(trainer.unwrapped, self.tokenizer, self.records, self.rewards, self.max_new_tokens)
            else:
                scores = evaluate(trainer.unwrapped, self.tokenizer, self.records, self.rewards, self.max_new_tokens)
            record["heldout_reward"] = scores["reward"]
            record.update({f"heldout/{k}": v for k, v in scores.items() if k not in ("reward", "prompts")})


