"""Prime Intellect's `verifiers` environments (the classic API: 0.1.9 up to 0.3.x, `verifiers.legacy`).

`verifiers:MODULE[:k=v,...]` imports the installed module MODULE (`-` read as `_`, as verifiers
does) and calls its `load_environment(**args)`. Its dataset's rows become prompt records (the
chat prompt, `answer`, `info`, `example_id`, every other column; the tools, in the OpenAI form
chat templates take, under `tools`), its eval dataset the held-out split. Its rubric is a reward:
the completions of one prompt are scored the way verifiers scores a group of rollouts
(`Rubric.score_group` on states built from the record: group-level reward functions see the
group, as in verifiers' own training loop), and each completion's weighted sum is its value. A `SingleTurnEnv` is sampled like any
prompt; every other environment runs episodes (episodes.py). verifiers 0.4's "v1" tasksets are
not read: pin `verifiers<0.4`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from collections import Counter
from typing import Any, Iterator

from paths.envs.spec import EXTRA, EnvSpec
from paths.errors import ConfigurationError, DataError

_LOADED: dict[str, Any] = {}


def _vf() -> Any:
    try:
        import verifiers as vf
    except ImportError:
        raise ConfigurationError(f"verifiers environments need the verifiers package: {EXTRA}") from None
    if not hasattr(vf, "SingleTurnEnv"):
        raise ConfigurationError(f"verifiers {getattr(vf, '__version__', '?')} has no classic environments (SingleTurnEnv, Rubric): pip install 'verifiers>=0.1.9,<0.4'")
    return vf


class _SignatureCache:
    """`inspect` for verifiers' rubric module, with `signature` remembered per function: its
    `score_rollout` reads each reward function's signature about 20 times per rollout, 60% of the
    scoring time (a function's signature never changes, so the answers are the same)."""

    def __init__(self) -> None:
        import inspect

        self._inspect = inspect
        self._seen: dict[Any, Any] = {}

    def signature(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return self._inspect.signature(fn, *args, **kwargs)
        try:
            return self._seen[fn]
        except (KeyError, TypeError):
            sig = self._inspect.signature(fn)
            with contextlib.suppress(TypeError):
                self._seen[fn] = sig
            return sig

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inspect, name)


def _cache_signatures() -> None:
    with contextlib.suppress(ImportError):
        from verifiers.legacy.rubrics import rubric

        if not isinstance(rubric.inspect, _SignatureCache):
            rubric.inspect = _SignatureCache()


def load(spec: EnvSpec) -> Any:
    """The environment a spec names, loaded once per process (verifiers registers signal handlers:
    the first load must happen on the main thread)."""
    if spec.text in _LOADED:
        return _LOADED[spec.text]
    vf = _vf()
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # our own progress bars say what is happening
    try:
        env = vf.load_environment(spec.name, **spec.args)
    except ValueError as exc:
        if "Could not import" in str(exc):
            module = spec.name.replace("-", "_").split("/")[-1]
            raise ConfigurationError(f"verifiers environment {spec.text!r}: no module {module!r} is installed here: pip install the package that provides it (prime env install, or pip install -e DIR)") from None
        raise ConfigurationError(f"verifiers environment {spec.text!r}: load_environment raised {_one_line(exc)}") from None
    except Exception as exc:  # the environment's own code failed: its words, in one line
        cause = exc.__cause__ or exc
        raise ConfigurationError(f"verifiers environment {spec.text!r}: load_environment raised {_one_line(cause)}") from None
    _cache_signatures()
    _LOADED[spec.text] = env
    return env


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def is_episodic(env: Any) -> bool:
    """Does the environment answer model turns (multi-turn, tools), or take one completion?"""
    return not isinstance(env, _vf().SingleTurnEnv)


def openai_tools(env: Any) -> list[dict[str, Any]]:
    """The environment's tools in the form chat templates take: {"type": "function", "function": {...}}."""
    out = []
    for tool in getattr(env, "tool_defs", None) or []:
        t = tool if isinstance(tool, dict) else tool.model_dump()
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description") or "", "parameters": t.get("parameters") or {}}})
    return out


def plain(value: Any) -> Any:
    """A dataset value as JSON: pydantic messages as dicts, keys that are None dropped from messages."""
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def rows(spec: EnvSpec) -> Iterator[dict[str, Any]]:
    """The environment's train rows, then its eval rows (held out), as prompt records."""
    env = load(spec)
    tools = openai_tools(env)
    splits = [("train", env.get_dataset())]
    if getattr(env, "eval_dataset", None) is not None:
        splits.append(("heldout", env.get_eval_dataset()))
    for split, data in splits:
        if data is None:
            continue
        for i, row in enumerate(data):
            record = {k: plain(v) for k, v in row.items() if v is not None}
            if isinstance(record.get("task"), str):  # verifiers 0.3 refuses plain-string task routes at rollout
                record["env_task"] = record.pop("task")
            if isinstance(record.get("prompt"), str):
                record["prompt"] = [{"role": "user", "content": record["prompt"]}]
            record.setdefault("answer", "")
            record["id"] = f"{spec.name}-{split}-{record.get('example_id', i)}"
            record["_split"] = split
            if tools:
                record["tools"] = tools
            yield record


def rollout_input(record: dict[str, Any]) -> dict[str, Any]:
    """The row verifiers' rollout and rubric take, from a prompt record."""
    row = {k: v for k, v in record.items() if k not in ("ids", "prompt", "messages", "tools", "env_task", "id")}
    row["prompt"] = record["messages"]
    row.setdefault("example_id", 0)
    return row


def check_score(spec: str, reward: Any, metrics: dict[str, Any] | None) -> float:
    """The rubric's reward as a float; a one-line error for None, NaN or infinity."""
    if reward is None:
        raise DataError(f"reward {spec!r}: the rubric returned None: every reward function must return a float")
    value = float(reward)
    if math.isnan(value) or math.isinf(value):
        bad = next((k for k, v in (metrics or {}).items() if v is None or not math.isfinite(float(v))), "?")
        raise DataError(f"reward {spec!r}: the rubric's reward is {value} (from {bad!r}): fix that reward function")
    return value


async def _score_group(env: Any, record: dict[str, Any], completions: list[str], client: Any) -> list[tuple[Any, dict[str, Any]]]:
    """One prompt's completions, scored together as verifiers scores a group of rollouts."""
    from verifiers.legacy.utils.message_utils import normalize_messages

    states = []
    for text in completions:
        state = await env.init_state(rollout_input(record), client, "paths", {})
        state["completion"] = normalize_messages([{"role": "assistant", "content": text}], field_name="completion")
        states.append(state)
    await env.rubric.score_group(states)
    return [(s["reward"], s["metrics"] or {}) for s in states]


def prompt_groups(n: int, same: Any) -> list[range]:
    """Runs of consecutive rows that share a prompt (`same(i, j)`): the groups a GRPO batch holds."""
    out, start = [], 0
    for i in range(1, n + 1):
        if i == n or not same(start, i):
            out.append(range(start, i))
            start = i
    return out


_FAILED = re.compile(r"Error calling (group )?reward function (\S+): (.*)", re.DOTALL)


class _Failures(logging.Handler):
    """verifiers logs a reward function that raised (or returned None) and scores it 0: counted here."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count: Counter[str] = Counter()  # per rollout
        self.groups: Counter[str] = Counter()  # per group (a group-level function fails once for its group)
        self.last: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if m := _FAILED.match(record.getMessage()):
            (self.groups if m.group(1) else self.count)[m.group(2)] += 1
            self.last[m.group(2)] = " ".join(m.group(3).split())


@contextlib.contextmanager
def rubric_failures(spec: str, n: int, groups: int | None = None) -> Iterator[None]:
    """Score inside this: a rubric function that failed on all `n` rollouts (a group-level one on
    all `groups` groups) is an error; one that fails on some keeps verifiers' 0 for those."""
    handler = _Failures()
    logger = logging.getLogger("verifiers")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    for name, count in [*handler.count.items(), *((k, v * n // max(1, groups or n)) for k, v in handler.groups.items())]:
        if count >= n:
            raise DataError(f"reward {spec!r}: rubric function {name!r} failed on all {n} completions ({handler.last[name]}): "
                            "it must return a float (None and errors score 0 in verifiers)")


class RubricReward:
    """A verifiers environment's rubric as a `--reward`: one weighted score per single-turn completion."""

    def __init__(self, spec: EnvSpec):
        self.spec, self.env = spec, load(spec)
        self.__name__ = spec.text

    def __call__(self, completions: list[str], messages: list[Any] | None = None, **fields: Any) -> list[float]:
        from paths.envs.client import LocalClient

        if messages is None:
            raise DataError(f"reward {self.spec.text!r} needs chat prompts: shard the dataset from the {self.spec.text} input")
        n = len(completions)
        records = [{"messages": messages[i], **{k: v[i] for k, v in fields.items() if k not in ("prompts", "completion_ids", "_group")}} for i in range(n)]
        client = LocalClient(None)
        index = fields.get("_group")  # each row's prompt in the batch (sampling.record_fields): a prompt drawn twice is two groups
        groups = prompt_groups(n, (lambda i, j: index[i] == index[j]) if index is not None else
                               (lambda i, j: records[i].get("example_id") == records[j].get("example_id") and records[i]["messages"] == records[j]["messages"]))

        async def score_all() -> list[tuple[Any, dict[str, Any]]]:
            scored = await asyncio.gather(*(_score_group(self.env, records[g[0]], [completions[i] for i in g], client) for g in groups))
            return [x for group in scored for x in group]

        with rubric_failures(self.spec.label, n, len(groups)):
            scored = _run(score_all())
        return [check_score(self.spec.label, reward, metrics) for reward, metrics in scored]


def _run(coro: Any) -> Any:
    """Run a coroutine to completion from synchronous code (a fresh event loop each time)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    raise RuntimeError("paths drives verifiers environments from synchronous code; it was called inside a running event loop")


def describe(spec: EnvSpec) -> dict[str, Any]:
    """What kind of environment this is, for messages and summaries."""
    env = load(spec)
    return {"spec": spec.text, "class": type(env).__name__, "episodic": is_episodic(env), "max_turns": getattr(env, "max_turns", None),
            "tools": [t["function"]["name"] for t in openai_tools(env)]}

