"""GRPO with verifiable rewards, as small pieces: rollout -> reward -> advantage -> loss.

Per optimizer step: take `grad_accum x batch_size` prompts, sample `group_size` completions for
each with the current policy (batched generation, KV cache), score them, normalise rewards within
each group (the advantage), then optimise the clipped surrogate token by token, micro-batch by
micro-batch. With `iterations` > 1 the same rollouts serve that many optimizer steps against the
log-probabilities they were sampled with; with `beta` > 0 a frozen copy of the starting weights
adds the k3 KL estimate. Loss normalisation follows TRL for each `loss` type, computed over the
whole step so that accumulating 4 micro-batches of 1 equals 1 of 4.

Shapes: N completions (prompts x G), P prompt tokens (left-padded), C completion tokens.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from paths.errors import ConfigurationError, DataError
from paths.work.rewards import Reward, score

if TYPE_CHECKING:
    from paths.train_config import TrainConfig

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
Scale = Literal["group", "batch", "none"]


# -- advantage ---------------------------------------------------------------------------------------
def group_advantages(rewards_N: torch.Tensor, group: int, scale: Scale) -> torch.Tensor:
    """reward - its group's mean, divided by the group's std (`group`), the batch's (`batch`) or
    nothing (`none`, Dr. GRPO); a group whose rewards are all equal gets zero advantage."""
    r_GK = rewards_N.view(-1, group)  # (prompts, G)
    centred = (r_GK - r_GK.mean(1, keepdim=True)).view(-1)
    if scale == "group":
        return centred / (r_GK.std(1, keepdim=True).expand_as(r_GK).reshape(-1) + 1e-4)
    if scale == "batch":
        return centred / (rewards_N.std() + 1e-4)
    return centred


# -- loss pieces ---------------------------------------------------------------------------------------
def clipped_surrogate(logp_NC: torch.Tensor, old_NC: torch.Tensor, adv_N: torch.Tensor, eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A), and where clipping is active."""
    rho = torch.exp(logp_NC - old_NC)
    a = adv_N.unsqueeze(1)  # (N, 1)
    unclipped, clipped = rho * a, torch.clamp(rho, 1 - eps_low, 1 + eps_high) * a
    return -torch.min(unclipped, clipped), (clipped < unclipped)


def kl_k3(logp_NC: torch.Tensor, ref_NC: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(ref - logp) - (ref - logp) - 1."""
    d = ref_NC - logp_NC
    return torch.exp(d) - d - 1


def reduce_loss(per_token_NC: torch.Tensor, mask_NC: torch.Tensor, loss: LossType, step_completions: int, step_tokens: int, max_new_tokens: int) -> torch.Tensor:
    """This micro-batch's share of the step's loss, normalised as TRL defines each type:
    grpo: mean over sequences of each sequence's token mean; bnpo and dapo: sum over all tokens of
    the step / the step's completion tokens; dr_grpo: sum / (completions x max_new_tokens)."""
    masked = per_token_NC * mask_NC
    if loss == "grpo":
        return (masked.sum(1) / mask_NC.sum(1).clamp(min=1)).sum() / step_completions
    if loss in ("bnpo", "dapo"):
        return masked.sum() / max(1, step_tokens)
    if loss == "dr_grpo":
        return masked.sum() / (step_completions * max_new_tokens)
    raise ConfigurationError(f"unknown --loss {loss!r}: use grpo, bnpo, dr_grpo or dapo")


# -- rollouts ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class Rollout:
    """One step's completions: token ids, masks, rewards, advantages, sampling log-probs."""

    ids_NT: torch.Tensor  # prompt (left-padded) + completion
    attention_NT: torch.Tensor
    prompt_len: int
    completion_mask_NC: torch.Tensor
    advantages_N: torch.Tensor
    rewards_N: torch.Tensor
    old_logp_NC: torch.Tensor | None
    ref_logp_NC: torch.Tensor | None
    reward_means: dict[str, float]
    completions: list[str]
    seconds: float


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), left-padded so every completion starts at the same column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def completion_logprobs(model: torch.nn.Module, ids_NT: torch.Tensor, attention_NT: torch.Tensor, prompt_len: int, temperature: float) -> torch.Tensor:
    """log pi(token) of each completion token, (N, C), at the sampling temperature."""
    positions = (attention_NT.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids_NT, attention_mask=attention_NT, position_ids=positions).logits  # (N, T, V)
    logits = logits[:, prompt_len - 1 : -1].float() / temperature  # predictions of the completion
    return torch.log_softmax(logits, -1).gather(-1, ids_NT[:, prompt_len:].unsqueeze(-1)).squeeze(-1)


def sample_tokens(logits_NV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), restricted to the top-p nucleus."""
    probs = torch.softmax(logits_NV.float() / temperature, -1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest set reaching top_p
        sorted_p[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1).squeeze(-1)


@functools.cache
def _cache_argument(model_class: type) -> str:
    """transformers >= 5.x names the KV-cache argument `cache`; older releases `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


@torch.no_grad()
def generate(model: torch.nn.Module, ids_NP: torch.Tensor, mask_NP: torch.Tensor, max_new_tokens: int, temperature: float, top_p: float, eos_id: int, pad_id: int) -> torch.Tensor:
    """Sampled completions (N, C) with a KV cache: one prefill, then one token per forward.
    A lean loop instead of `generate()`: for small models its per-token bookkeeping costs as much
    as the forward pass. Rows that produced EOS continue with padding."""
    from transformers import DynamicCache

    kv = {_cache_argument(type(model)): DynamicCache()}
    positions = (mask_NP.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids_NP, attention_mask=mask_NP, position_ids=positions, use_cache=True, **kv).logits[:, -1]
    mask, pos = mask_NP, positions[:, -1:]
    done = torch.zeros(len(ids_NP), dtype=torch.bool)
    out = []
    for _ in range(max_new_tokens):
        token = torch.where(done, pad_id, sample_tokens(logits, temperature, top_p))  # (N,)
        out.append(token)
        done |= token == eos_id
        if done.all() or len(out) == max_new_tokens:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        pos = pos + 1
        logits = model(input_ids=token.unsqueeze(1), attention_mask=mask, position_ids=pos, use_cache=True, **kv).logits[:, -1]
    return torch.stack(out, dim=1)


@torch.no_grad()
def sample(model: torch.nn.Module, prompts: list[list[int]], cfg: TrainConfig, tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """G completions per prompt, batched: (prompt + completion ids, attention, P, completion mask)."""
    ids, mask = left_pad([p for p in prompts for _ in range(cfg.group_size)], tokenizer.pad_token_id)
    was_training = model.training
    model.eval()
    completion = generate(model, ids, mask, cfg.max_new_tokens, cfg.temperature, cfg.top_p, tokenizer.eos_token_id, tokenizer.pad_token_id)
    model.train(was_training)
    out = torch.cat([ids, completion], dim=1)
    is_eos = completion == tokenizer.eos_token_id
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((len(completion),), completion.shape[1]))
    cmask = (torch.arange(completion.shape[1]).unsqueeze(0) <= first_eos.unsqueeze(1)).long()  # up to EOS, included
    attention = torch.cat([mask, cmask], dim=1)
    return out, attention, ids.shape[1], cmask


def rollout(model: torch.nn.Module, ref_model: torch.nn.Module | None, records: list[dict[str, Any]], rewards: list[Reward], cfg: TrainConfig, tokenizer: Any) -> Rollout:
    """Sample, score and compute advantages (and old / reference log-probs when needed)."""
    t0 = time.perf_counter()
    ids, attention, p, cmask = sample(model, [r["ids"] for r in records], cfg, tokenizer)
    texts = tokenizer.batch_decode(torch.where(cmask.bool(), ids[:, p:], tokenizer.pad_token_id), skip_special_tokens=True)
    prompts = [r["prompt"] for r in records for _ in range(cfg.group_size)]
    answers = [r["answer"] for r in records for _ in range(cfg.group_size)]
    values, means = score(rewards, prompts, texts, answers)
    r = torch.tensor(values, dtype=torch.float32)
    old = ref = None
    with torch.no_grad():
        if cfg.iterations > 1:
            old = completion_logprobs(model, ids, attention, p, cfg.temperature)
        if ref_model is not None:
            ref = completion_logprobs(ref_model, ids, attention, p, cfg.temperature)
    return Rollout(ids, attention, p, cmask, group_advantages(r, cfg.group_size, cfg.scale_rewards), r, old, ref, means, texts, time.perf_counter() - t0)


def check_prompts(records: list[dict[str, Any]], rewards: list[Reward], dataset: str) -> None:
    """A reward that needs answers needs a dataset that has them."""
    needy = [r.spec for r in rewards if r.needs_answers]
    if needy and not any(rec["answer"].strip() for rec in records):
        raise DataError(f"reward {needy[0]!r} needs answers but dataset {dataset!r} has none: shard prompts with --answer-field")


# -- one optimizer step -----------------------------------------------------------------------------
def grpo_backward(model: torch.nn.Module, acc: Any, ro: Rollout, cfg: TrainConfig, micro_rows: list[slice]) -> dict[str, float]:
    """Loss and gradients of one rollout, micro-batch by micro-batch (sums to the step's loss)."""
    n = len(ro.advantages_N)
    tokens = int(ro.completion_mask_NC.sum())
    eps_high = cfg.epsilon_high or cfg.epsilon
    total, clipped, kl_sum = 0.0, 0, 0.0
    for rows in micro_rows:
        mask = ro.completion_mask_NC[rows].float()
        logp = completion_logprobs(model, ro.ids_NT[rows], ro.attention_NT[rows], ro.prompt_len, cfg.temperature)
        old = logp.detach() if ro.old_logp_NC is None else ro.old_logp_NC[rows]
        per_token, is_clipped = clipped_surrogate(logp, old, ro.advantages_N[rows], cfg.epsilon, eps_high)
        if ro.ref_logp_NC is not None and cfg.beta > 0:
            kl = kl_k3(logp, ro.ref_logp_NC[rows])
            per_token = per_token + cfg.beta * kl
            kl_sum += float((kl.detach() * mask).sum())
        loss = reduce_loss(per_token, mask, cfg.loss, n, tokens, cfg.max_new_tokens)
        acc.backward(loss)
        total += float(loss.detach())
        clipped += int((is_clipped.float() * mask).sum())
    groups = ro.rewards_N.view(-1, cfg.group_size)
    return {
        "loss": total, "tokens": tokens, "reward_mean": float(ro.rewards_N.mean()), "reward_std": float(ro.rewards_N.std()) if n > 1 else 0.0,
        "zero_variance_groups": float((groups.std(1) == 0).float().mean()), "completion_length": tokens / n,
        "kl": kl_sum / max(1, tokens), "clip_fraction": clipped / max(1, tokens), "completions_per_s": n / max(1e-9, ro.seconds),
        **{f"reward/{k}": v for k, v in ro.reward_means.items()},
    }


class GRPOStep:
    """The `paths train --mode grpo` step: a rollout every `iterations` optimizer steps."""

    def __init__(self, cfg: TrainConfig, records: list[dict[str, Any]], rewards: list[Reward], tokenizer: Any, ref_model: torch.nn.Module | None=None):
        self.cfg, self.records, self.rewards, self.tokenizer, self.ref_model = cfg, records, rewards, tokenizer, ref_model
        self.current: Rollout | None = None
        self.used = 0
        self.checkpoint_multiple = cfg.iterations  # rollouts are not saved: checkpoint between them

    def __call__(self, model: torch.nn.Module, acc: Any, it: Any) -> dict[str, float]:
        if self.current is None or self.used == self.cfg.iterations:
            batches = [next(it) for _ in range(self.cfg.grad_accum)]
            chosen = [self.records[int(i)] for b in batches for i in b["index"]]
            self.current, self.used = rollout(model, self.ref_model, chosen, self.rewards, self.cfg, self.tokenizer), 0
        self.used += 1
        rows = self.cfg.batch_size * self.cfg.group_size
        n = len(self.current.advantages_N)
        return grpo_backward(model, acc, self.current, self.cfg, [slice(i, i + rows) for i in range(0, n, rows)])


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokenizer: Any, records: list[dict[str, Any]], rewards: list[Reward], max_new_tokens: int, batch: int = 32) -> dict[str, float]:
    """Mean of each reward (and their weighted sum) over greedy completions of the records."""
    was_training = model.training
    model.eval()
    texts: list[str] = []
    for i in range(0, len(records), batch):
        chunk = records[i : i + batch]
        ids, mask = left_pad([r["ids"] for r in chunk], tokenizer.pad_token_id)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        texts += tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    total, means = score(rewards, [r["prompt"] for r in records], texts, [r["answer"] for r in records])
    return {"reward": sum(total) / max(1, len(total)), **means, "prompts": len(records)}
