"""Multi-turn episodes as GRPO samples: the environment drives, the path's sampler answers.

`Turns` is the model side: it keeps each episode's tokens exactly as sampled (token in, token out:
nothing is lost to re-tokenising the model's own words), renders only what the environment added
since the model's last turn, and batches the turns of concurrent episodes (a forward pass runs
when every live episode is waiting for the model). Tool calls are read from the model's text
(`<tool_call>{...}</tool_call>`), since verifiers takes them only as structured calls.

For each prompt record, `group` episodes run concurrently through verifiers' own rollout loop
(`env.rollout`: model turn, `env_response`, stop conditions, tools run by the environment), with
`LocalClient` as the model; the rubric scores each record's episodes together (`score_group`).
Each episode becomes one completion: every token after the prompt,
the environment's marked as context (out of the loss), the model's with the log-probs they were
sampled with. The episode's budget is `max_new_tokens` tokens in all; one that outgrows it is cut
and counted as truncated. Rewards: the environment's rubric on the finished episode (its
`score_group`), plus any other `--reward` on the model's last turn. In a mixture, rows of other
(single-turn) sources are one model turn each, sampled in the same batches, scored by their own
scorers: everything about them (keys, seeded numbers, replay) is an episode's with no environment.

Through rollout workers (worker.py, verify.py): a worker samples each model token with its seeded
number for that position of the episode (`uniforms`: one row of numbers per episode, indexed by
the position in the completion, so the environment's tokens use none). The trainer replays the
batch with `Replay`: verifiers runs each episode again, the model's turns taken from the batch
(each must be what a sampler stops at: up to EOS, or the token budget), the environment's answers
computed anew; the replayed transcript must equal the batch's token for token, and the rubric
scores the replayed episode. An environment that says it is not deterministic (`deterministic =
False` on it) has its answers recorded by the worker (`environment_answers`) and played back
on the trainer, which then trusts the worker for what the environment said (README: what stays
trusted).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

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

    def __init__(self, model: torch.nn.Module | None, tokenizer: Any, template: str, *, budget: int, temperature: float, top_p: float, chunk: int = 64,
                 uniforms: dict[str, torch.Tensor] | None = None):
        from paths.work.sampling import device_of

        self.model, self.tokenizer, self.template, self.budget = model, tokenizer, template, budget
        self.temperature, self.top_p, self.chunk = temperature, top_p, chunk
        self.device = device_of(model) if model is not None else torch.device("cpu")
        self.uniforms = uniforms  # episode -> (budget,) seeded numbers, one per completion position (a rollout worker's)
        self.transcripts: dict[str, Transcript] = {}
        self.pending: list[tuple[str, list[int], int, asyncio.Future]] = []
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
        ids, logprobs = await self._sample(key, prompt, remaining)
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

    async def _sample(self, key: str, ids: list[int], max_new: int) -> tuple[list[int], list[float]]:
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.pending.append((key, ids, max_new, future))
        self._flush_if_ready()
        return await future

    def _flush_if_ready(self) -> None:
        """Sample every waiting turn at once, when no live episode is still busy elsewhere."""
        if not self.pending or len(self.pending) < self.live:
            return
        batch, self.pending = self.pending, []
        try:
            results = self._generate([b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch])
        except Exception as exc:  # every waiting episode learns of it
            for *_, future in batch:
                future.set_exception(exc)
            return
        for (*_, future), result in zip(batch, results):
            future.set_result(result)

    def _numbers(self, keys: list[str], prompts: list[list[int]], width: int) -> torch.Tensor | None:
        """Each turn's seeded numbers from its episode's position on (0.5 past the budget, where
        nothing is kept)."""
        if self.uniforms is None:
            return None
        u = torch.full((len(keys), width), 0.5)
        for j, (key, prompt) in enumerate(zip(keys, prompts)):
            at = len(prompt) - len(self.transcripts[key].prompt_ids)
            row = self.uniforms[key][at : at + width]
            u[j, : len(row)] = row
        return u

    @torch.inference_mode()
    def _generate(self, keys: list[str], prompts: list[list[int]], limits: list[int]) -> list[tuple[list[int], list[float]]]:
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
                u = self._numbers(keys[i : i + self.chunk], prompts[i : i + self.chunk], width)
                seqs = generate(self.model, ids, mask, width, self.temperature, self.top_p, eos, pad, uniforms_NC=None if u is None else u.to(self.device),
                                logprobs=steps).tolist()
                lps = torch.stack(steps, 1).tolist()
                self.forwards += 1
                for seq, lp, limit in zip(seqs, lps, limits[i : i + self.chunk]):
                    seq = seq[:limit]
                    n = seq.index(eos) + 1 if eos in seq else len(seq)
                    out.append((seq[:n], lp[:n]))
        finally:
            self.model.train(was_training)
        return out


def episode_keys(records: int, group: int) -> list[str]:
    """The episodes' names, in row order: "record.k" for the k-th of each record's group."""
    return [f"{i}.{k}" for i in range(records) for k in range(group)]


class Diverged(DataError):
    """A replayed episode that is not the batch's: the worker's transcript is not what its turns and the environment give."""


class Replay(Turns):
    """The model's turns of a rollout batch's episodes, played back: each turn is the batch's next
    model tokens, as a sampler would have stopped (at EOS, or at the budget)."""

    def __init__(self, tokenizer: Any, template: str, budget: int, recorded: dict[str, tuple[list[int], list[int]]]):
        super().__init__(None, tokenizer, template, budget=budget, temperature=1.0, top_p=1.0)
        self.recorded = recorded  # episode -> (completion ids, model mask)

    def _generate(self, keys: list[str], prompts: list[list[int]], limits: list[int]) -> list[tuple[list[int], list[float]]]:
        eos, out = self.tokenizer.eos_token_id, []
        for key, prompt, limit in zip(keys, prompts, limits):
            ids, mask = self.recorded[key]
            at = len(prompt) - len(self.transcripts[key].prompt_ids)
            turn = ids[at : at + limit]
            turn = turn[: turn.index(eos) + 1] if eos in turn else turn
            if not turn or not all(mask[at : at + len(turn)]) or (eos not in turn and len(turn) < limit):
                raise Diverged(f"episode {key}: the model's turn at token {at} is not in the batch as a sampler leaves it (model tokens up to EOS or the budget)")
            out.append((turn, [0.0] * len(turn)))
        return out


@contextlib.contextmanager
def environment_answers(env: Any, played: dict[str, list[Any]] | None = None) -> Iterator[dict[str, list[Any]]]:
    """While open, each episode's environment answers (its `env_response`s, as JSON) are recorded
    in the dict yielded; with `played`, they are not computed but taken from it, in order."""
    from paths.envs.vf_env import plain

    said: dict[str, list[Any]] = {}
    own = env.env_response

    async def answer(messages: Any, state: Any, **kwargs: Any) -> Any:
        key = state["input"]["paths_episode"]
        if played is None:
            out = await own(messages, state, **kwargs)
        elif len(played.get(key) or []) <= len(said.get(key, [])):
            raise Diverged(f"episode {key}: the batch records fewer environment answers than its turns need")
        else:
            out = played[key][len(said.get(key, []))]
        said.setdefault(key, []).append(plain(out))
        return out

    had = vars(env).get("env_response")
    env.env_response = answer
    try:
        yield said
    finally:
        if had is None:
            del env.env_response  # the class's own again
        else:
            env.env_response = had


def deterministic(env: Any) -> bool:
    """Does the environment answer the same conversation the same way (so a trainer can replay it)?
    Environments say otherwise with `deterministic = False`."""
    return bool(getattr(env, "deterministic", True))


class EpisodeSampler:
    """`sample(model, records, rewards, cfg, tokenizer) -> Samples` for an environment that answers turns."""

    def __init__(self, spec: EnvSpec, template: str):
        self.spec, self.env, self.template = spec, load(spec), template
        self.deterministic = deterministic(self.env)
        self.last: dict[str, float] = {}
        self.said: dict[str, list[Any]] = {}  # the last episodes' environment answers (recorded for a rollout batch)

    def episodes(self, turns: Turns, records: list[dict[str, Any]], group: int, played: dict[str, list[Any]] | None = None) -> list[tuple[str, Any]]:
        """Run `group` episodes per record, the model's turns from `turns`; [(key, finished state)] in
        record order (key "record.k"). `played`: the environment's answers, taken from a batch."""
        client = LocalClient(turns)

        async def single(key: str, record: dict[str, Any]) -> tuple[str, Any]:  # a row of another source in a mixture: one model turn
            t = turns.open(key, record["ids"])
            try:
                ids, logprobs = await turns._sample(key, record["ids"], turns.budget)
            finally:
                turns.close(key)
            t.add(ids, model=True, logprobs=logprobs)
            t.turns, t.truncated = 1, turns.tokenizer.eos_token_id not in ids
            return key, None

        async def one(key: str, record: dict[str, Any]) -> tuple[str, Any]:
            if not self.mine(record):
                return await single(key, record)
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
            return key, state

        from paths.envs.vf_env import rubric_failures

        async def run_all() -> list[tuple[str, Any]]:
            finished = list(await asyncio.gather(*(one(key, r) for key, r in zip(episode_keys(len(records), group), (r for r in records for _ in range(group))))))
            for i in range(0, len(finished), group):  # each record's episodes scored together, as verifiers scores a group of rollouts
                states = [state for _, state in finished[i : i + group] if state is not None]
                if states:
                    await self.env.rubric.score_group(states)
            return finished

        own = sum(self.mine(r) for r in records)
        with rubric_failures(self.spec.label, own * group, own), environment_answers(self.env, played) as self.said:
            return asyncio.run(run_all())

    def mine(self, record: dict[str, Any]) -> bool:
        """Is the record this environment's (an episode), or another source's in a mixture (one turn)?"""
        return record.get("env") == self.spec.label  # every row of an environment carries its label (sources.py)

    def __call__(self, model: torch.nn.Module, records: list[dict[str, Any]], rewards: list[Reward], cfg: TrainConfig, tokenizer: Any) -> Samples:
        return self.samples(model, records, rewards, tokenizer, group=cfg.group_size, budget=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                            chunk=cfg.generation_batch_size or cfg.batch_size * cfg.group_size)

    def samples(self, model: torch.nn.Module, records: list[dict[str, Any]], rewards: list[Reward], tokenizer: Any, *, group: int, budget: int, temperature: float,
                top_p: float, chunk: int, uniforms: torch.Tensor | None = None) -> Samples:
        """`group` scored episodes per record (`uniforms`: (records x group, budget) seeded numbers, a rollout worker's)."""
        numbers = None if uniforms is None else dict(zip(episode_keys(len(records), group), uniforms))
        turns = Turns(model, tokenizer, self.template, budget=budget, temperature=temperature, top_p=top_p, chunk=chunk, uniforms=numbers)
        return self.scored(turns, self.episodes(turns, records, group), records, rewards, group)

    def replay(self, records: list[dict[str, Any]], rewards: list[Reward], tokenizer: Any, group: int, budget: int, completion_ids: list[list[int]],
               model_masks: list[list[int]], played: list[list[Any]] | None) -> Samples:
        """A batch's episodes again, the model's turns taken from it (the environment's answers from
        `played` when given); Diverged when the replayed transcript is not the batch's."""
        keys = episode_keys(len(records), group)
        turns = Replay(tokenizer, self.template, budget, dict(zip(keys, zip(completion_ids, model_masks))))
        finished = self.episodes(turns, records, group, None if played is None else dict(zip(keys, played)))
        for r, (key, _) in enumerate(finished):
            t = turns.transcripts[key]
            if t.completion_ids != completion_ids[r] or t.model_mask != model_masks[r]:
                at = next((i for i, (a, b) in enumerate(zip(t.completion_ids, completion_ids[r])) if a != b), min(len(t.completion_ids), len(completion_ids[r])))
                raise Diverged(f"row {r}: the replayed episode differs from the batch's from token {at} on (the environment's answers, or where they were put)")
        return self.scored(turns, finished, records, rewards, group)

    def scored(self, turns: Turns, finished: list[tuple[str, Any]], records: list[dict[str, Any]], rewards: list[Reward], group: int) -> Samples:
        """The finished episodes as Samples: the rubric's reward plus any other reward's on the model's last turn."""
        from paths.work.grpo import Samples
        from paths.work.rewards import score
        from paths.work.sampling import record_fields

        from paths.work.grpo import source_means

        transcripts = [turns.transcripts[key] for key, _ in finished]
        states = [state for _, state in finished if state is not None]  # None: a single turn of another source (mixtures)
        rubric = [None if s is None else check_score(self.spec.label, s["reward"], s["metrics"]) for _, s in finished]
        values = [v or 0.0 for v in rubric]
        texts = [turns.tokenizer.decode(t.completion_ids, skip_special_tokens=True) if s is None else last_model_turn(s) for t, (_, s) in zip(transcripts, finished)]
        scored = [v for v in rubric if v is not None]
        means: dict[str, float] = {self.spec.label: sum(scored) / len(scored)} if scored else {}
        for name in sorted({k for s in states for k in (s["metrics"] or {})}):
            got = [float(s["metrics"][name]) for s in states if (s["metrics"] or {}).get(name) is not None]
            if got:
                means[f"{self.spec.label}/{name}"] = sum(got) / len(got)
        if rewards:  # other rewards read the model's last turn (other sources' scorers: their own rows)
            extra, extra_means = score(rewards, [r["prompt"] for r in records for _ in range(group)], texts, [t.completion_ids for t in transcripts],
                                       record_fields(records, group))
            values = [v + e for v, e in zip(values, extra)]
            means.update(extra_means)
        episodes = [t for t, (_, s) in zip(transcripts, finished) if s is not None] or transcripts
        self.last = {"episode/turns": sum(t.turns for t in episodes) / len(episodes), "episode/forwards": float(turns.forwards),
                     "episode/environment_tokens": sum(len(t.model_mask) - sum(t.model_mask) for t in episodes) / len(episodes),
                     "episode/model_tokens": sum(sum(t.model_mask) for t in episodes) / len(episodes),
                     "episode/truncated": sum(t.truncated for t in episodes) / len(episodes)}
        means.update(self.last)
        means.update(source_means(records, group, values, [t.completion_ids for t in transcripts], [t.truncated for t in transcripts]))
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
    if len(episodic) > 1:
        raise ConfigurationError(f"dataset {dataset!r} mixes {len(episodic)} multi-turn environments ({', '.join(s.text for s in episodic)}): "
                                 "shard each into a dataset of its own (single-turn sources may join one)")
    from paths.envs.chat import template_of
    from paths.models import run_tokenizer
    from sharding.dataset import dataset_manifest

    options = (dataset_manifest(run, dataset).get("fingerprint") or {}).get("options") or {}
    tokenizer, _ = run_tokenizer(run)
    return EpisodeSampler(episodic[0], template_of(tokenizer, options.get("chat_template"), f"dataset {dataset!r}"))


def dataset_scoring(run: Any, dataset: str, names: list[str]) -> tuple[list[Reward], EpisodeSampler | None]:
    """What a GRPO trainer or rollout worker scores `dataset` with: the rewards (`names`, else the
    dataset's environments' own), and the sampler of its multi-turn environment, if it has one
    (whose rubric then scores the episodes)."""
    from paths.envs.spec import check_versions
    from paths.work.rewards import load_reward, reward_specs
    from sharding.dataset import dataset_manifest

    manifest = dataset_manifest(run, dataset)
    environments = manifest.get("environments") or []
    check_versions(environments, f"dataset {dataset!r}")
    from paths.envs.spec import is_env

    plain = [i for i in ((manifest.get("fingerprint") or {}).get("options") or {}).get("inputs", []) if not is_env(i)]
    if environments and plain and not names:
        raise ConfigurationError(f"dataset {dataset!r} mixes environments with plain prompts ({plain[0]}), which no environment scores: "
                                 "name the rewards (e.g. --reward env --reward math_answer: a named reward scores every row, an environment's only its own), or shard them apart")
    episodes = episode_sampler(run, dataset, environments)
    return [load_reward(r) for r in reward_specs(names, environments, dataset, skip=episodes.spec.text if episodes else None)], episodes


def dataset_rewards(run: Any, dataset: str, names: list[str]) -> list[Reward]:
    """The rewards a prompt dataset is scored with: `names` (`env` for its environments), else its
    environments' own scorers, else math_answer, for single completions (rejection sampling): a
    multi-turn environment here is an error (`dataset_scoring` gives its episodes)."""
    rewards, episodes = dataset_scoring(run, dataset, names)
    if episodes is not None:
        raise ConfigurationError(f"dataset {dataset!r} comes from the multi-turn environment {episodes.spec.text!r}: its episodes run in `paths train` and `paths rollout`; "
                                 "rejection sampling takes single completions")
    return rewards


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
