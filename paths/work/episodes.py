"""Multi-turn episodes as GRPO samples: the environment drives, the path's sampler answers.

`Turns` is the model side: it keeps each episode's tokens exactly as sampled (token in, token out:
nothing is lost to re-tokenising the model's own words), renders only what the environment added
since the model's last turn, and batches the turns of concurrent episodes (a forward pass runs
when every live episode is waiting for the model). Tool calls are read from the model's text
(`<tool_call>{...}</tool_call>`), since verifiers takes them only as structured calls.

For each prompt record, `group` episodes run concurrently through verifiers' own rollout loop
(`env.rollout`: model turn, `env_response`, stop conditions, tools run by the environment), with
`LocalClient` as the model. Each episode becomes one completion: every token after the prompt,
the environment's marked as context (out of the loss), the model's with the log-probs they were
sampled with. The episode's budget is `max_new_tokens` tokens in all; one that outgrows it is cut
and counted as truncated. Rewards: the environment's rubric on the finished episode (its
`score_rollout`), plus any other `--reward` on the model's last turn.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from paths.envs.chat import render, tool_calls
from paths.envs.client import LocalClient
from paths.envs.spec import EnvSpec, parse
from paths.envs.vf_env import check_score, load, rollout_input
from paths.errors import ConfigurationError, DataError

if TYPE_CHECKING:
    from paths.train_config import TrainConfig
    from paths.work.grpo import Samples
    from paths.work.rewards import Reward


@dataclass(slots=True)
class Transcript:
    """One episode's tokens: the prompt, then model and environment tokens, and which are the model's."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)  # 1: sampled by the model; 0: the environment's (context only)
    logprobs: list[float] = field(default_factory=list)  # the sampler's log-prob of each model token; 0 for the environment's
    seen: int = 0  # messages in the prompt of the model's last turn
    truncated: bool = False  # the episode outgrew its token budget
    turns: int = 0

    def add(self, ids: list[int], model: bool, logprobs: list[float] | None = None) -> None:
        self.completion_ids += ids
        self.model_mask += [int(model)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


class Turns:
    """Model turns of concurrent episodes, sampled in batches, with each episode's transcript."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, template: str, *, budget: int, temperature: float, top_p: float, chunk: int = 64):
        from paths.work.sampling import device_of

        self.model, self.tokenizer, self.template, self.budget = model, tokenizer, template, budget
        self.temperature, self.top_p, self.chunk, self.device = temperature, top_p, chunk, device_of(model)
        self.transcripts: dict[str, Transcript] = {}
        self.pending: list[tuple[list[int], int, asyncio.Future]] = []
        self.live = 0
        self.forwards = 0  # batched sampling calls, for the metrics
        eos = tokenizer.eos_token
        self.eos_text = eos if isinstance(eos, str) else ""

    def open(self, key: str, prompt_ids: list[int]) -> Transcript:
        self.transcripts[key] = t = Transcript(list(prompt_ids))
        self.live += 1
        return t

    def close(self, key: str) -> None:
        self.live -= 1
        self._flush_if_ready()

    async def respond(self, key: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The model's next turn in episode `key`, given the whole conversation so far."""
        from verifiers.legacy.errors import OverlongPromptError

        t = self.transcripts[key]
        if t.truncated:
            raise OverlongPromptError(f"episode {key} used its {self.budget} tokens")
        if t.turns:  # what the environment said since the model's last turn, rendered as the template would
            t.add(self._environment_ids(messages, t.seen, tools), model=False)
        remaining = self.budget - len(t.completion_ids)
        if remaining <= 0:  # the environment's answer alone filled the budget: cut it there
            del t.completion_ids[self.budget :], t.model_mask[self.budget :], t.logprobs[self.budget :]
            t.truncated = True
            raise OverlongPromptError(f"episode {key} used its {self.budget} tokens")
        prompt = t.prompt_ids + t.completion_ids
        ids, logprobs = await self._sample(prompt, remaining)
        eos = self.tokenizer.eos_token_id
        t.add(ids, model=True, logprobs=logprobs)
        t.seen, t.turns = len(messages), t.turns + 1
        t.truncated = eos not in ids
        content, calls = tool_calls(self.tokenizer.decode(ids, skip_special_tokens=True))
        finish = "length" if t.truncated else "tool_calls" if calls else "stop"
        return {"text": content, "tool_calls": calls, "prompt_ids": prompt, "completion_ids": ids, "logprobs": logprobs, "finish_reason": finish}

    def _environment_ids(self, messages: list[dict[str, Any]], seen: int, tools: list[dict[str, Any]] | None) -> list[int]:
        """Tokens of the messages after the model's last turn, up to the next assistant header.

        The conversation is rendered twice, up to the model's turn and whole; the difference, from
        the end of the model's turn (its EOS) on, is what the environment added. A template that
        rewrites earlier turns (not append-only) cannot be trained on token by token: an error."""
        before = render(self.tokenizer, messages[: seen + 1], self.template, tools, generation=False)
        whole = render(self.tokenizer, messages, self.template, tools, generation=True)
        if not whole.startswith(before):
            raise DataError("the chat template renders earlier turns differently once later ones follow: multi-turn training needs an append-only template (pass --chat-template FILE)")
        end = before.rfind(self.eos_text) if self.eos_text else -1
        start = end + len(self.eos_text) if end >= 0 else len(before)
        return self.tokenizer(whole[start:], add_special_tokens=False)["input_ids"]

    async def _sample(self, ids: list[int], max_new: int) -> tuple[list[int], list[float]]:
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.pending.append((ids, max_new, future))
        self._flush_if_ready()
        return await future

    def _flush_if_ready(self) -> None:
        """Sample every waiting turn at once, when no live episode is still busy elsewhere."""
        if not self.pending or len(self.pending) < self.live:
            return
        batch, self.pending = self.pending, []
        try:
            results = self._generate([b[0] for b in batch], [b[1] for b in batch])
        except Exception as exc:  # every waiting episode learns of it
            for _, _, future in batch:
                future.set_exception(exc)
            return
        for (_, _, future), result in zip(batch, results):
            future.set_result(result)

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], limits: list[int]) -> list[tuple[list[int], list[float]]]:
        from paths.work.sampling import generate, left_pad

        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        out: list[tuple[list[int], list[float]]] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for i in range(0, len(prompts), self.chunk):
                ids, mask = left_pad(prompts[i : i + self.chunk], pad, self.device)
                width = max(limits[i : i + self.chunk])
                steps: list[torch.Tensor] = []
                seqs = generate(self.model, ids, mask, width, self.temperature, self.top_p, eos, pad, logprobs=steps).tolist()
                lps = torch.stack(steps, 1).tolist()
                self.forwards += 1
                for seq, lp, limit in zip(seqs, lps, limits[i : i + self.chunk]):
                    seq = seq[:limit]
                    n = seq.index(eos) + 1 if eos in seq else len(seq)
                    out.append((seq[:n], lp[:n]))
        finally:
            self.model.train(was_training)
        return out


class EpisodeSampler:
    """`sample(model, records, rewards, cfg, tokenizer) -> Samples` for an environment that answers turns."""

    def __init__(self, spec: EnvSpec, template: str):
        self.spec, self.env, self.template = spec, load(spec), template
        self.last: dict[str, float] = {}

    def episodes(self, model: torch.nn.Module, records: list[dict[str, Any]], group: int, tokenizer: Any, *, budget: int, temperature: float, top_p: float,
                 chunk: int = 64) -> tuple[Turns, list[tuple[str, Any]]]:
        """Run `group` episodes per record; (the transcripts, [(key, finished state)] in record order)."""
        turns = Turns(model, tokenizer, self.template, budget=budget, temperature=temperature, top_p=top_p, chunk=chunk)
        client = LocalClient(turns)

        async def one(key: str, record: dict[str, Any]) -> tuple[str, Any]:
            turns.open(key, record["ids"])
            try:
                state = await self.env.rollout({**rollout_input(record), "paths_episode": key}, client, "paths", {})
            except DataError:
                raise
            except Exception as exc:  # the environment's own code failed: its words, in one line
                raise DataError(f"environment {self.spec.text!r}: an episode failed ({type(exc).__name__}: {' '.join(str(exc).split())})") from None
            finally:
                turns.close(key)
            _raise_failure(self.spec, state)
            await self.env.rubric.score_rollout(state)
            return key, state

        from paths.envs.vf_env import rubric_failures

        async def run_all() -> list[tuple[str, Any]]:
            return list(await asyncio.gather(*(one(f"{i}.{k}", r) for i, r in enumerate(records) for k in range(group))))

        with rubric_failures(self.spec.label, len(records) * group):
            finished = asyncio.run(run_all())
        return turns, finished

    def __call__(self, model: torch.nn.Module, records: list[dict[str, Any]], rewards: list[Reward], cfg: TrainConfig, tokenizer: Any) -> Samples:
        return self.samples(model, records, rewards, tokenizer, group=cfg.group_size, budget=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                            chunk=cfg.generation_batch_size or cfg.batch_size * cfg.group_size)

    def samples(self, model: torch.nn.Module, records: list[dict[str, Any]], rewards: list[Reward], tokenizer: Any, *, group: int, budget: int, temperature: float,
                top_p: float, chunk: int) -> Samples:
        """`group` scored episodes per record."""
        from paths.work.grpo import Samples
        from paths.work.rewards import score
        from paths.work.sampling import record_fields

        turns, finished = self.episodes(model, records, group, tokenizer, budget=budget, temperature=temperature, top_p=top_p, chunk=chunk)
        transcripts = [turns.transcripts[key] for key, _ in finished]
        states = [state for _, state in finished]
        values = [check_score(self.spec.label, s["reward"], s["metrics"]) for s in states]
        texts = [last_model_turn(s) for s in states]
        means: dict[str, float] = {self.spec.label: sum(values) / len(values)}
        for name in sorted({k for s in states for k in (s["metrics"] or {})}):
            got = [float(s["metrics"][name]) for s in states if (s["metrics"] or {}).get(name) is not None]
            if got:
                means[f"{self.spec.label}/{name}"] = sum(got) / len(got)
        if rewards:  # other rewards read the model's last turn
            extra, extra_means = score(rewards, [r["prompt"] for r in records for _ in range(group)], texts, [t.completion_ids for t in transcripts],
                                       record_fields(records, group))
            values = [v + e for v, e in zip(values, extra)]
            means.update(extra_means)
        self.last = {"episode/turns": sum(t.turns for t in transcripts) / len(transcripts), "episode/forwards": float(turns.forwards),
                     "episode/environment_tokens": sum(len(t.model_mask) - sum(t.model_mask) for t in transcripts) / len(transcripts),
                     "episode/model_tokens": sum(sum(t.model_mask) for t in transcripts) / len(transcripts),
                     "episode/truncated": sum(t.truncated for t in transcripts) / len(transcripts)}
        means.update(self.last)
        return Samples(records, [t.completion_ids for t in transcripts], [t.truncated for t in transcripts], texts, values, means,
                       model_masks=[t.model_mask for t in transcripts], logprobs=[t.logprobs for t in transcripts])


    def evaluate(self, model: torch.nn.Module, tokenizer: Any, records: list[dict[str, Any]], rewards: list[Reward], max_new_tokens: int) -> dict[str, float]:
        """Mean reward of one greedy episode per record (what `paths eval` and held-out rewards report)."""
        if not records:
            return {"reward": 0.0, "prompts": 0}
        samples = self.samples(model, records, rewards, tokenizer, group=1, budget=max_new_tokens, temperature=0.0, top_p=1.0, chunk=64)
        return {"reward": sum(samples.rewards) / len(samples.rewards), **samples.reward_means, "prompts": len(records)}


def episode_sampler(run: Any, dataset: str, environments: list[dict[str, Any]]) -> EpisodeSampler | None:
    """The sampler that runs episodes, when the dataset comes from an environment that answers turns."""
    specs = [parse(e["spec"]) for e in environments if e["spec"].startswith("verifiers:")]
    if not specs:
        return None
    from paths.envs.vf_env import is_episodic

    episodic = [s for s in specs if is_episodic(load(s))]
    if not episodic:
        return None
    if len(environments) > 1:
        raise ConfigurationError(f"dataset {dataset!r} mixes {len(environments)} environments, one of them multi-turn ({episodic[0].text}): shard a multi-turn environment into a dataset of its own")
    from paths.envs.chat import template_of
    from paths.models import run_tokenizer
    from sharding.dataset import dataset_manifest

    options = (dataset_manifest(run, dataset).get("fingerprint") or {}).get("options") or {}
    tokenizer, _ = run_tokenizer(run)
    return EpisodeSampler(episodic[0], template_of(tokenizer, options.get("chat_template"), f"dataset {dataset!r}"))


def last_model_turn(state: Any) -> str:
    """The text of the model's last turn in a finished episode."""
    for m in reversed(state.get("completion") or []):
        if getattr(m, "role", None) == "assistant":
            return m.content or ""
    return ""


def _raise_failure(spec: EnvSpec, state: Any) -> None:
    """An episode that ended in an error other than running out of tokens: the error, in one line."""
    from verifiers.legacy.errors import OverlongPromptError

    error = state.get("error")
    if error is None:
        return
    cause = error.__cause__ or error
    if isinstance(cause, OverlongPromptError) or isinstance(error, OverlongPromptError):
        return
    if isinstance(cause, (DataError,)):
        raise cause
    raise DataError(f"environment {spec.text!r}: an episode failed ({type(cause).__name__}: {' '.join(str(cause).split())})")
