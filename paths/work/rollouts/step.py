"""The `--rollouts store` GRPO step: verified batches of rollout workers (policy at most max_async
versions old), the ratio taken against their behaviour log-probs with mismatched tokens masked;
with none usable within rollout_wait seconds the trainer samples the step itself."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch

from paths.work.grpo import GRPOStep, Samples, grpo_backward, micro_slices, to_rollout
from paths.work.rollouts.sapo import take_external
from paths.work.rollouts.seeds import pick_prompts
from paths.work.rollouts.source import StoreRollouts


class AsyncGRPOStep(GRPOStep):
    """grad_accum batches from the store (or sampled here), SAPO's external groups, one update."""

    def __init__(self, cfg: Any, source: StoreRollouts, ref_model: torch.nn.Module | None = None, dataset: str = "?"):
        super().__init__(cfg, source.records, source.rewards, source.tokenizer, ref_model, dataset, sampler=source.episodes)
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
                seed = hashlib.sha256(f"trainer-{src.path}/{src.steps * cfg.grad_accum + k}".encode()).digest()
                picked = pick_prompts(seed, cfg.batch_size, len(src.records), src.mixture)
                samples = self.sample(policy, [src.records[i] for i in picked], self.rewards, cfg, self.tokenizer)
                parts.append(samples)
                behaviour += [None] * len(samples.completion_ids)
                versions.append(src.steps)
        external = take_external(src, cfg.external) if cfg.external else None
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
        ro.behaviour_logp_NC = self._behaviour(ro, behaviour)
        src.steps += 1
        return grpo_backward(model, acc, ro, cfg, micro_slices(ro, cfg))

    def _behaviour(self, ro: Any, rows: list[list[float] | None]) -> torch.Tensor:
        """(N, C) behaviour log-probs: the workers' where they sampled; NaN where the current policy
        is the behaviour (sampled here, or another path's rows under SAPO), which the loss reads as
        its own detached log-probs: no second forward pass for them."""
        out = torch.full(ro.completion_mask_NC.shape, float("nan"), dtype=torch.float32)
        for i, r in enumerate(rows):
            if r is not None:
                out[i] = 0.0
                out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
        return out.to(ro.completion_mask_NC.device)
