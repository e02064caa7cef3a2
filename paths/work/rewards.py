"""Verifiable rewards for GRPO: `reward(prompts, completions, answers) -> list[float]`.

Built in: `math_answer` (the completion's final number equals the answer), `format` (the answer
is given where the prompt asked: `Answer: <number>`, or `\\boxed{}` when the prompt says so),
`length_penalty` (0 up to 200 characters, then down to -1 at 400). A user reward is any importable
`module:function` with the same signature. `--reward SPEC[=WEIGHT]` combines several, weighted.
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from typing import Callable

from paths.errors import ConfigurationError, DataError

RewardFn = Callable[[list[str], list[str], list[str]], list[float]]
_NUMBER = r"-?\d+(?:\.\d+)?(?:/\d+)?"
_BOXED = re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}")
_ANSWER = re.compile(r"Answer:\s*(" + _NUMBER + r")")
_ANY = re.compile(_NUMBER)


def _value(text: str) -> float | None:
    try:
        if "/" in text:
            a, b = text.split("/")
            return float(a) / float(b)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(completion: str) -> float | None:
    """The final number: in \\boxed{}, else after 'Answer:', else the last number in the text."""
    for pattern in (_BOXED, _ANSWER, _ANY):
        found = pattern.findall(completion)
        if found:
            return _value(found[-1])
    return None


def math_answer(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the extracted number equals the answer (relative tolerance 1e-6), else 0.0."""
    out = []
    for completion, answer in zip(completions, answers):
        got, want = extract_answer(completion), _value(answer.strip())
        out.append(1.0 if got is not None and want is not None and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9) else 0.0)
    return out


def format_reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the completion gives its answer in the form the prompt asked for."""
    out = []
    for prompt, completion in zip(prompts, completions):
        pattern = _BOXED if "boxed" in prompt else _ANSWER
        out.append(1.0 if pattern.search(completion) else 0.0)
    return out


def length_penalty(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """0 up to 200 characters, then linearly down to -1 at 400 and beyond."""
    return [-min(1.0, max(0, len(c) - 200) / 200) for c in completions]


math_answer.needs_answers = True  # type: ignore[attr-defined]
BUILTIN: dict[str, RewardFn] = {"math_answer": math_answer, "format": format_reward, "length_penalty": length_penalty}


@dataclass(frozen=True, slots=True)
class Reward:
    """One weighted reward function and the spec it came from (for messages)."""

    spec: str
    fn: RewardFn
    weight: float

    @property
    def needs_answers(self) -> bool:
        return bool(getattr(self.fn, "needs_answers", False))


def load_reward(spec: str) -> Reward:
    """`NAME[=WEIGHT]` (built in) or `module:function[=WEIGHT]`."""
    name, _, weight_text = spec.partition("=")
    try:
        weight = float(weight_text) if weight_text else 1.0
    except ValueError:
        raise ConfigurationError(f"--reward {spec}: the weight after '=' must be a number") from None
    if name in BUILTIN:
        return Reward(name, BUILTIN[name], weight)
    if ":" not in name:
        raise ConfigurationError(f"--reward {name!r} is not a built-in reward ({', '.join(BUILTIN)}) nor module:function")
    module_name, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"--reward {name!r} cannot be imported ({type(exc).__name__}: {exc}): check the module path and function name") from None
    if not callable(fn):
        raise ConfigurationError(f"--reward {name!r} is not callable: give a function (prompts, completions, answers) -> list[float]")
    return Reward(name, fn, weight)


def score(rewards: list[Reward], prompts: list[str], completions: list[str], answers: list[str]) -> tuple[list[float], dict[str, float]]:
    """Weighted sum per completion, and each reward's mean (for the metrics)."""
    total = [0.0] * len(completions)
    means = {}
    for r in rewards:
        values = r.fn(prompts, completions, answers)
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            got = len(values) if hasattr(values, "__len__") else type(values).__name__
            raise DataError(f"reward {r.spec!r} returned {got} values for {len(completions)} completions: it must return one float per completion")
        values = [float(v) for v in values]
        if any(math.isnan(v) or math.isinf(v) for v in values):
            raise DataError(f"reward {r.spec!r} returned NaN or infinity: fix the reward function")
        total = [t + r.weight * v for t, v in zip(total, values)]
        means[r.spec] = sum(values) / max(1, len(values))
    return total, means
