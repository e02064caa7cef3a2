"""A `paths` ensemble of dense causal LMs: shipped inside each ensemble folder (`paths compose
--into ensemble`) and loaded with `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`.
It needs only torch and transformers.

The folder holds config.json (model_type `paths_ensemble`), this file, the tokenizer, and each
member as an HF checkpoint in members/<name>/. Members may differ in width and depth; they share
the tokenizer. The next-token distribution is a mixture of the members':

    p(x_t | x_<t) = sum_j p_j(x_t | x_<t) w_j(t)

- mix "posterior" (ELMForest, Branch-Train-Merge): w_j(t) = P(j | x_<t), proportional to
  P(x_<t | j) P(j): the prior times the member's likelihood of the prefix so far;
- mix "uniform": w_j = 1 / J;
- mix "router" (DiPaCo): one member per sequence, chosen from its first `prefix_tokens` tokens by
  the run's saved sharding router (k-means or MoE routing over the base model in router/model/).

forward() returns the mixture's log-probabilities as `logits` (softmax of them is the mixture);
generate() decodes greedily or by sampling with a KV cache per member.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class PathsEnsembleConfig(PretrainedConfig):
    model_type = "paths_ensemble"

    def __init__(self, members: list[str]=None, mix: str="posterior", prior: Any=None, vocab_size: int=None, router: Any=None,
                 max_position_embeddings: int | None=None, **kwargs: Any):
        self.members = list(members or [])
        self.max_position_embeddings = max_position_embeddings  # the smallest member's context
        self.mix = mix
        self.prior = list(prior) if prior is not None else None
        self.vocab_size = vocab_size
        self.router = router  # mix "router": kind, prefix_tokens, choices per member, blocks / modules
        super().__init__(**kwargs)


class PathsEnsembleForCausalLM(PreTrainedModel):
    config_class = PathsEnsembleConfig
    base_model_prefix = "ensemble"
    _no_split_modules: list[str] = []
    main_input_name = "input_ids"

    def __init__(self, config: PathsEnsembleConfig):
        super().__init__(config)
        self.members = nn.ModuleList()
        self.router_model = None
        self.register_buffer("centroids", torch.zeros(0), persistent=False)

    def _init_weights(self, module: torch.nn.Module):  # members arrive trained
        pass

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, *model_args: Any, config: dict[str, Any]=None, **kwargs: Any):
        folder = str(pretrained_model_name_or_path)
        if not os.path.isdir(folder):
            from huggingface_hub import snapshot_download

            folder = snapshot_download(folder, revision=kwargs.get("revision"), cache_dir=kwargs.get("cache_dir"), local_files_only=kwargs.get("local_files_only", False))
        if not isinstance(config, PathsEnsembleConfig):
            config = PathsEnsembleConfig.from_pretrained(folder)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        dtype = None if dtype in (None, "auto") else dtype
        model = cls(config)
        if not config.members:
            raise ValueError(f"paths ensemble {folder}: config.json lists no members")
        for name in config.members:
            sub = os.path.join(folder, "members", name)
            if not os.path.exists(os.path.join(sub, "config.json")):
                raise OSError(f"paths ensemble {folder}: member {name!r} is missing (no members/{name}/config.json): restore it or compose the ensemble again")
            model.members.append(AutoModelForCausalLM.from_pretrained(sub, dtype=dtype or torch.float32).eval())
        if config.mix == "router":
            sub = os.path.join(folder, "router", "model")
            if not os.path.exists(os.path.join(sub, "config.json")):
                raise OSError(f"paths ensemble {folder}: mix 'router' but router/model/ is missing: compose the ensemble again")
            model.router_model = AutoModelForCausalLM.from_pretrained(sub, dtype=torch.float32).eval()
            if config.router["kind"] == "kmeans":
                from safetensors.torch import load_file

                model.centroids = load_file(os.path.join(folder, "router", "router.safetensors"))["centroids"]
        model.eval()
        return model

    def can_generate(self) -> bool:
        return True

    # -- the mixture --------------------------------------------------------------------------
    def _cache_name(self, member: str) -> str:
        params = inspect.signature(member.forward).parameters
        return "cache" if "cache" in params else "past_key_values"

    def _member_step(self, member: str, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, cache: Any, use_cache: bool):
        """(log-probs (B, T, V) over the shared vocabulary, the member's new cache)."""
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, "use_cache": use_cache}
        if cache is not None:
            kwargs[self._cache_name(member)] = cache
        out = member(**kwargs)
        logits = out.logits[..., : self.config.vocab_size].float()
        new_cache = None
        if use_cache:  # transformers >= 5.2x names it cache, earlier versions past_key_values
            new_cache = out.get("cache")
            if new_cache is None:
                new_cache = out.get("past_key_values")
        return torch.log_softmax(logits, dim=-1), new_cache

    def _log_prior(self, device: torch.device | str | None) -> torch.Tensor:
        J = len(self.members)
        prior = torch.tensor(self.config.prior, dtype=torch.float64) if self.config.prior else torch.full((J,), 1.0 / J, dtype=torch.float64)
        return prior.clamp_min(1e-30).log().float().to(device)  # (J,)

    def _route(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """(B,) the member the saved router picks from each sequence's first tokens (DiPaCo)."""
        r = self.config.router
        t = int(r["prefix_tokens"])
        ids, mask = input_ids[:, :t], attention_mask[:, :t]
        weights = (mask / mask.sum(1, keepdim=True).clamp_min(1)).unsqueeze(-1).float()  # (B, T, 1)
        if r["kind"] == "kmeans":
            h = self.router_model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state.float()  # (B, T, H)
            feats = (h * weights).sum(1)  # (B, H): mean over the prefix
            levels = [torch.cdist(feats[:, b:e], self.centroids[g, :, : e - b].float()) ** 2 for g, (b, e) in enumerate(r["blocks"])]
            scores = -torch.stack(levels, dim=1)  # (B, G, E)
        else:  # "moe": the base's routers, probabilities averaged over the prefix and each level's layers
            captured = {}
            hooks = [
                self.router_model.get_submodule(name).register_forward_hook(lambda m, a, o, k=k: captured.__setitem__(k, o[0] if isinstance(o, tuple) else o))
                for k, name in enumerate(r["modules"])
            ]
            try:
                self.router_model(input_ids=ids, attention_mask=mask)
            finally:
                for h in hooks:
                    h.remove()
            b, tt = ids.shape
            per_level = []
            for span in r["level_layers"]:
                probs = [(captured[k].reshape(b, tt, -1).float().softmax(-1) * weights).sum(1) for k in span]
                per_level.append(torch.stack(probs).mean(0))
            scores = torch.stack(per_level, dim=1).clamp_min(1e-12).log()  # (B, G, E)
        choices = torch.tensor(r["choices"], dtype=torch.long, device=scores.device)  # (J, G)
        per_member = sum(scores[:, g, choices[:, g]] for g in range(choices.shape[1]))  # (B, J)
        return per_member.argmax(-1)

    def _weights(self, log_lik: torch.Tensor, route: torch.Tensor | None) -> torch.Tensor:
        """log w (J, B, ...) from each member's log-likelihood of the prefix (J, B, ...)."""
        J = log_lik.shape[0]
        if self.config.mix == "uniform":
            return torch.full_like(log_lik, -math.log(J))
        if self.config.mix == "router":
            onehot = torch.nn.functional.one_hot(route, J).T.float()  # (J, B)
            w = onehot.log()
            return w.view(J, -1, *([1] * (log_lik.dim() - 2))).expand_as(log_lik)
        prior = self._log_prior(log_lik.device).view(J, *([1] * (log_lik.dim() - 1)))
        return torch.log_softmax(prior + log_lik, dim=0)

    def _prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, use_cache: bool = False):
        """Every member over the sequence: (log-probs (J, B, T, V), log-likelihood of each token
        given the ones before (J, B, T-1; padding and the first token count 0), the router's
        choice or None, the members' caches)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        steps = [self._member_step(m, input_ids, attention_mask, position_ids, None, use_cache) for m in self.members]
        lp = torch.stack([s[0] for s in steps])
        route = self._route(input_ids, attention_mask) if self.config.mix == "router" else None
        m = (attention_mask[:, 1:] * attention_mask[:, :-1]).float()  # (B, T-1)
        tok = lp[:, :, :-1].gather(-1, input_ids[:, 1:].expand(lp.shape[0], -1, -1).unsqueeze(-1)).squeeze(-1) * m
        return lp, tok, route, [s[1] for s in steps]

    @staticmethod
    def _cumulative(tok: torch.Tensor) -> torch.Tensor:
        """(J, B, T): each member's log-likelihood of the prefix x_<=t."""
        return torch.cat([torch.zeros_like(tok[..., :1]), tok.cumsum(-1)], dim=-1)

    def forward(self, input_ids: torch.Tensor=None, attention_mask: torch.Tensor | None=None, labels: torch.Tensor | None=None, **kwargs: Any):
        lp, tok, route, _ = self._prefix(input_ids, attention_mask)  # lp: (J, B, T, V)
        w = self._weights(self._cumulative(tok), route)
        mixed = torch.logsumexp(lp + w.unsqueeze(-1), dim=0)  # (B, T, V) log-probabilities
        loss = None
        if labels is not None:
            loss = torch.nn.functional.nll_loss(mixed[:, :-1].reshape(-1, mixed.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=mixed)

    def mixture_weights(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None=None) -> torch.Tensor:
        """(B, T, J): each member's weight at each position."""
        _, tok, route, _ = self._prefix(input_ids, attention_mask)
        return self._weights(self._cumulative(tok), route).exp().permute(1, 2, 0)

    # -- decoding -----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor=None, attention_mask: torch.Tensor | None=None, max_new_tokens: int | None=None, do_sample: bool | None=None,
                 temperature: float | None=None, top_p: float | None=None, eos_token_id: int | list[int] | None=None, pad_token_id: int | None=None,
                 generator: torch.Generator | None=None, max_length: int | None=None, stopping_criteria: Any=None, logits_processor: Any=None,
                 generation_config: Any=None, top_k: int | None=None, **kwargs: Any):
        """Decode from the mixture: greedy, or sampling with temperature / top_p / top_k; each member
        keeps its own KV cache, and the posterior is updated with every token. Returns (B, T + new).

        Takes what transformers' `generate` is called with by lm-eval, TRL and pipelines:
        `max_length` (prompt included) when `max_new_tokens` is not given, `stopping_criteria` and
        `logits_processor` lists (honoured), a `generation_config` (its fields are defaults), and
        `use_cache`, `output_scores`, `synced_gpus`, ... (harmless here, ignored). Beam search and
        dict outputs are refused."""
        if kwargs.get("num_beams", 1) != 1 or kwargs.get("return_dict_in_generate"):
            raise TypeError("paths ensemble generate(): beam search and return_dict_in_generate are not supported; decode greedily or by sampling")
        gc = generation_config
        pick = lambda given, name, default: given if given is not None else (getattr(gc, name, None) if gc is not None and getattr(gc, name, None) is not None else default)  # noqa: E731
        max_length = pick(max_length, "max_length", None) if max_new_tokens is None else None
        max_new_tokens = pick(max_new_tokens, "max_new_tokens", None)
        if max_new_tokens is None:
            max_new_tokens = max(0, max_length - input_ids.shape[1]) if max_length is not None else 20
        do_sample, temperature, top_p, top_k = pick(do_sample, "do_sample", False), pick(temperature, "temperature", 1.0), pick(top_p, "top_p", 1.0), pick(top_k, "top_k", 0)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        eos = pick(eos_token_id, "eos_token_id", self.config.eos_token_id)
        eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else set()
        pad = pick(pad_token_id, "pad_token_id", self.config.pad_token_id)
        pad = 0 if pad is None else pad
        lp, tok, route, caches = self._prefix(input_ids, attention_mask, use_cache=True)
        log_lik, last = tok.sum(-1), lp[:, :, -1]  # (J, B), (J, B, V)
        next_pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -1:] + 1
        out, done = input_ids, torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            mixed = torch.logsumexp(last + self._weights(log_lik, route).unsqueeze(-1), dim=0)  # (B, V)
            if logits_processor is not None:
                mixed = logits_processor(out, mixed)
            if do_sample and top_k:
                mixed = mixed.masked_fill(mixed < mixed.topk(min(top_k, mixed.shape[-1]), dim=-1).values[:, -1:], float("-inf"))
            token = self._pick(mixed, do_sample, temperature, top_p, generator)  # (B,)
            token = torch.where(done, torch.full_like(token, pad), token)
            out = torch.cat([out, token[:, None]], dim=-1)
            done = done | torch.tensor([int(t) in eos for t in token], device=token.device)
            if stopping_criteria is not None:
                stop = stopping_criteria(out, mixed)
                done = done | (stop if isinstance(stop, torch.Tensor) else torch.full_like(done, bool(stop))).to(done.device).bool()
            if bool(done.all()):
                break
            log_lik = log_lik + last.gather(-1, token.view(1, -1, 1).expand(last.shape[0], -1, 1)).squeeze(-1) * (~done).float()
            attention_mask = torch.cat([attention_mask, torch.ones_like(token[:, None])], dim=-1)
            steps = [self._member_step(mm, token[:, None], attention_mask, next_pos, c, True) for mm, c in zip(self.members, caches)]
            caches = [c for _, c in steps]
            last = torch.stack([s[0][:, -1] for s in steps])
            next_pos = next_pos + 1
        return out

    @staticmethod
    def _pick(logp: torch.Tensor, do_sample: bool, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
        if not do_sample:
            return logp.argmax(-1)
        probs = torch.softmax(logp / max(temperature, 1e-6), dim=-1)
        if top_p < 1.0:
            sorted_p, order = probs.sort(-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < top_p
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator).squeeze(-1)


def write_config(folder: str, **fields: Any) -> None:
    """config.json with the auto_map that points transformers at this file."""
    config = PathsEnsembleConfig(**fields)
    config.auto_map = {"AutoConfig": "modeling_paths_ensemble.PathsEnsembleConfig", "AutoModelForCausalLM": "modeling_paths_ensemble.PathsEnsembleForCausalLM"}
    config.architectures = ["PathsEnsembleForCausalLM"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=2, sort_keys=True)
