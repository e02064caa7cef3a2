"""Verifiable rewards for GRPO, called the way TRL calls them.

A reward returns one value per completion: a float, or None where it does not apply. The call
convention is read once from the function's signature when it is loaded:
- TRL style, for a function with `**kwargs`, a `completion_ids` parameter or keyword-only
  parameters: `fn(prompts=..., completions=..., completion_ids=..., **fields)`, where `fields` are
  the prompt record's fields (`answer`, `id`, `level`, ...), each a list aligned with the
  completions; a function without `**kwargs` gets only the fields it names.
- positional (legacy) otherwise: `fn(prompts, completions, answers)`.
A completion's total is the weighted sum of its non-None values (TRL's nansum); a reward that
returns only None for a whole batch is an error, as are a wrong count, NaN and infinity.
A reward may say how it reads gold answers, so that bad data stops before training:
`fn.needs_answers = True` (the dataset must have answers) and `fn.check_answer(answer) -> bool`.

Built in: `math_answer` (the completion's final number equals the answer, exactly: integers,
decimals, `a/b`, `\\frac{a}{b}`), `format` (the answer is given where the prompt asked:
`Answer: <number>`, or `\\boxed{}` when the prompt says so), `length_penalty` (0 up to 200
characters, then down to -1 at 400), `math_verify` (symbolic equality by Hugging Face's
math-verify: `\\frac{\\sqrt2}{2}` = `\\sqrt{2}/2`; needs `pip install 'paths[math]'`). A user reward
is any importable `module:function`. `--reward SPEC[=WEIGHT]` combines several, weighted. An
environment's scorer is a reward too: `reasoning-gym:TASK`, `verifiers:MODULE[:k=v,...]`, or
`env` (every environment the dataset was sharded from).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

from paths.errors import ConfigurationError, DataError

RewardFn = Callable[..., list[float | None]]

# -- reading numbers ------------------------------------------------------------------------------
_DASHES = "-\u2010\u2011\u2012\u2013\u2014\u2015\u2212\ufe63\uff0d"  # ASCII, hyphens, en/em dash, minus sign
_TO_MINUS = str.maketrans({d: "-" for d in _DASHES})
# 1,234 only with groups of exactly three digits (so "1,2,3" and "1, 2" stay lists); .5 allowed.
_UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+(?!,?\d)|\d+)(?:\.\d+)?|\.\d+)"
_SIGNED = rf"[{_DASHES}+]?{_UNSIGNED}"
# A sign right after a word or a closing bracket is an operator: "5-3" is 5 and 3, not -3.
_NUMBER = (rf"(?P<sign>(?<![\w)\]}}])[{_DASHES}+])?(?:\\[dt]?frac\s*(?:\{{\s*(?P<fn>{_SIGNED})\s*\}}\s*\{{\s*(?P<fd>{_SIGNED})\s*\}}|(?P<fn1>\d)(?P<fd1>\d))"
           rf"|(?P<n>{_UNSIGNED})(?:\s*/\s*(?P<d>{_UNSIGNED}))?)")
_NUMBER_RE = re.compile(_NUMBER)
_ANSWER_RE = re.compile(r"\banswer\b\s*(?:is\b\s*:?|:)[\s*$\\(]*" + _NUMBER, re.IGNORECASE)  # "Answer: 12", "the answer is 12"
_BOXED_RE = re.compile(r"\\boxed\s*\{")
# What may surround a boxed number: units in \text{}, $, %, degrees, a leading "x =".
_DECOR_RE = re.compile(r"\\(?:text|mathrm|mbox)\{[^{}]*\}|\\?[$%]|\^\s*\{?\\circ\}?|\\[,!;]|^.*=")


def _plain(text: str) -> Fraction:
    return Fraction(text.translate(_TO_MINUS).replace(",", ""))


def _value(m: re.Match[str]) -> Fraction | None:
    try:
        if m["fn1"]:  # \frac12
            value = Fraction(int(m["fn1"]), int(m["fd1"]))
        else:
            value = _plain(m["fn"]) / _plain(m["fd"]) if m["fn"] else _plain(m["n"]) / (_plain(m["d"]) if m["d"] else 1)
    except ZeroDivisionError:
        return None
    return -value if m["sign"] and m["sign"] != "+" else value


def _normalize(text: str) -> str:
    return text.replace("{,}", ",").replace(",\\!", ",")  # LaTeX thousands: 1{,}234 and 1,\!234


def parse_number(text: str) -> Fraction | None:
    """The value of a string that is one number (12, -3, 1,234, .5, 0.25, 3/4, \\frac{1}{2}), else None."""
    m = _NUMBER_RE.fullmatch(_normalize(text).strip())
    return _value(m) if m else None


def _boxed(text: str) -> list[str]:
    """The contents of every \\boxed{...}, braces balanced."""
    out = []
    for m in _BOXED_RE.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end() : i - 1])
    return out


def extract_answer(completion: str) -> Fraction | None:
    """The final answer: the last \\boxed{}, else the last 'Answer: <number>', else the last number."""
    text = _normalize(completion)
    if boxes := _boxed(text):  # the last box that holds a number; boxes but no number: no answer (not a guess)
        return next((got for box in reversed(boxes) if (got := parse_number(_DECOR_RE.sub("", box).strip().rstrip("."))) is not None), None)
    for pattern in (_ANSWER_RE, _NUMBER_RE):
        if found := list(pattern.finditer(text)):
            return _value(found[-1])
    return None


# -- the built-in rewards -------------------------------------------------------------------------
def math_answer(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the extracted number equals the gold answer exactly (0.5 = 1/2; 1000001 != 1000000)."""
    out = []
    for completion, answer in zip(completions, answers):
        got, want = extract_answer(completion), parse_number(answer)
        out.append(1.0 if got is not None and got == want else 0.0)
    return out


def format_reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the completion gives its answer in the form the prompt asked for."""
    out = []
    for prompt, completion in zip(prompts, completions):
        if "boxed" in prompt:
            ok = any(parse_number(_DECOR_RE.sub("", b)) is not None for b in _boxed(_normalize(completion)))
        else:
            ok = _ANSWER_RE.search(_normalize(completion)) is not None
        out.append(1.0 if ok else 0.0)
    return out


def length_penalty(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """0 up to 200 characters, then linearly down to -1 at 400 and beyond."""
    return [-min(1.0, max(0, len(c) - 200) / 200) for c in completions]


def _import_math_verify() -> tuple[Callable, Callable]:
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ConfigurationError("--reward math_verify needs the math-verify library: pip install 'paths[math]'") from None
    return parse, verify


def _timeout() -> int | None:
    """math-verify's timeouts use SIGALRM, which only the main thread may set: off it, none."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def _parse_gold(parse: Callable, answer: str, timeout: int | None) -> list:
    text = answer.rpartition("####")[2].strip()  # GSM8K: the solution, then "#### 72"
    return parse(text if "$" in text or "\\boxed" in text else f"${text}$", parsing_timeout=timeout)


def math_verify_reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when math-verify finds the completion's answer equal to the gold one, symbolically."""
    parse, verify = _import_math_verify()
    timeout, golds, out = _timeout(), {}, []
    for completion, answer in zip(completions, answers):
        if answer not in golds:
            golds[answer] = _parse_gold(parse, answer, timeout)
        got = parse(completion, parsing_timeout=timeout)
        out.append(1.0 if golds[answer] and got and verify(golds[answer], got, timeout_seconds=timeout) else 0.0)
    return out


def _math_verify_reads(answer: str) -> bool:
    parse, _ = _import_math_verify()
    return bool(_parse_gold(parse, answer, _timeout()))


for _fn in (math_answer, math_verify_reward):
    _fn.needs_answers = True  # type: ignore[attr-defined]
math_answer.check_answer = lambda a: parse_number(a) is not None  # type: ignore[attr-defined]
math_answer.answer_form = "a number, a/b, \\frac{a}{b}, or a decimal"  # type: ignore[attr-defined]
math_verify_reward.check_answer = _math_verify_reads  # type: ignore[attr-defined]
math_verify_reward.answer_form = "a number or a LaTeX expression"  # type: ignore[attr-defined]
BUILTIN: dict[str, RewardFn] = {"math_answer": math_answer, "format": format_reward, "length_penalty": length_penalty, "math_verify": math_verify_reward}


# -- loading and calling --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Reward:
    """One weighted reward function, the spec it came from (for messages) and how to call it."""

    spec: str
    fn: RewardFn
    weight: float = 1.0
    keywords: bool = False  # TRL style: fn(prompts=, completions=, completion_ids=, **fields)
    accepts: frozenset[str] | None = None  # keyword names it takes; None: any (it has **kwargs)
    required: frozenset[str] = frozenset()  # the names it takes without a default

    @classmethod
    def of(cls, spec: str, fn: RewardFn, weight: float = 1.0) -> Reward:
        """A Reward whose call convention is read from the function's signature."""
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # some builtins and C callables have no signature: call them positionally
            return cls(spec, fn, weight)
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        names, required = frozenset(p.name for p in named), frozenset(p.name for p in named if p.default is p.empty)
        kinds = {p.kind for p in params}
        if inspect.Parameter.VAR_KEYWORD in kinds:
            return cls(spec, fn, weight, True, None, required)
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if "completion_ids" in names or inspect.Parameter.KEYWORD_ONLY in kinds or len(positional) != 3:
            return cls(spec, fn, weight, True, names, required)  # e.g. fn(completions, solution): by name
        return cls(spec, fn, weight)  # fn(prompts, completions, answers)

    @property
    def needs_answers(self) -> bool:
        return bool(getattr(self.fn, "needs_answers", False))

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]], fields: dict[str, list[Any]]) -> Any:
        if not self.keywords:
            return self.fn(prompts, completions, fields.get("answer", [""] * len(completions)))
        kwargs = {**fields, "prompts": prompts, "completions": completions, "completion_ids": completion_ids}
        if missing := sorted(self.required - kwargs.keys()):
            raise DataError(f"reward {self.spec!r} takes {', '.join(missing)} but the prompt records have only {', '.join(sorted(fields))}: "
                            "add the field to the dataset or give the parameter a default")
        return self.fn(**(kwargs if self.accepts is None else {k: v for k, v in kwargs.items() if k in self.accepts}))


def load_reward(spec: str) -> Reward:
    """`NAME[=WEIGHT]` (built in), `module:function[=WEIGHT]`, or an environment's own scorer:
    `reasoning-gym:TASK` (the task's score_answer) or `verifiers:MODULE[:k=v,...]` (its rubric,
    weighted inside)."""
    from paths.envs.spec import is_env, parse

    if is_env(spec):
        from paths.envs.sources import env_reward

        env = parse(spec)
        return Reward.of(env.label, env_reward(env))
    name, _, weight_text = spec.partition("=")
    try:
        weight = float(weight_text) if weight_text else 1.0
    except ValueError:
        raise ConfigurationError(f"--reward {spec}: the weight after '=' must be a number") from None
    if name in BUILTIN:
        if name == "math_verify":
            _import_math_verify()  # fail at load, not at the first rollout
        return Reward.of(name, BUILTIN[name], weight)
    if ":" not in name:
        raise ConfigurationError(f"--reward {name!r} is not a built-in reward ({', '.join(BUILTIN)}) nor module:function")
    module_name, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"--reward {name!r} cannot be imported ({type(exc).__name__}: {exc}): check the module path and function name") from None
    if not callable(fn):
        raise ConfigurationError(f"--reward {name!r} is not callable: give a function (prompts, completions, answers) -> list[float]")
    return Reward.of(name, fn, weight)


def reward_specs(names: list[str], environments: list[dict[str, Any]], dataset: str, skip: str | None = None) -> list[str]:
    """The rewards to load. `env` stands for the scorer of every environment the dataset was sharded
    from; with no reward named, a dataset from environments is scored by them, any other by
    `math_answer`. `skip`: an environment whose episodes score themselves."""
    envs = [e["spec"] for e in environments if e["spec"] != skip]
    if not names:
        return envs if environments else ["math_answer"]
    out = []
    for name in names:
        if name != "env":
            out.append(name)
        elif not environments:
            raise ConfigurationError(f"--reward env: dataset {dataset!r} was not sharded from an environment: name its rewards (e.g. --reward math_answer)")
        else:
            out += envs
    return out


def check_answers(rewards: list[Reward], records: list[dict[str, Any]], dataset: str) -> None:
    """Stop before training when a reward needs gold answers the dataset lacks or cannot parse."""
    needy = [r.spec for r in rewards if r.needs_answers]
    if needy and not any(str(rec.get("answer", "")).strip() for rec in records):
        raise DataError(f"reward {needy[0]!r} needs answers but dataset {dataset!r} has none: shard prompts with --answer-field")
    for r in rewards:
        check = getattr(r.fn, "check_answer", None)
        if check is None:
            continue
        seen: dict[str, bool] = {}
        for i, rec in enumerate(records):
            answer = str(rec.get("answer", ""))
            if answer not in seen:
                seen[answer] = bool(check(answer))
            if not seen[answer]:
                where = f"record {rec['id']!r}" if rec.get("id") is not None else f"record {i}"
                form = getattr(r.fn, "answer_form", "a value the reward can parse")
                raise DataError(f"dataset {dataset!r}: {where} has gold answer {answer!r} that reward {r.spec!r} cannot parse: fix the answer field ({form})")


def score(rewards: list[Reward], prompts: list[str], completions: list[str], completion_ids: list[list[int]],
          fields: dict[str, list[Any]]) -> tuple[list[float], dict[str, float]]:
    """Weighted sum per completion of the non-None values, and each reward's mean over its non-None values."""
    n = len(completions)
    assert len(prompts) == len(completion_ids) == n and all(len(v) == n for v in fields.values()), "score: inputs not aligned"
    total = [0.0] * n
    means = {}
    for r in rewards:
        try:
            values = r(prompts, completions, completion_ids, fields)
        except TypeError as exc:
            raise DataError(f"reward {r.spec!r} could not be called ({exc}): take (prompts, completions, answers), or keyword arguments with **kwargs") from None
        if hasattr(values, "tolist"):  # a numpy array or a tensor
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = len(values) if hasattr(values, "__len__") else type(values).__name__
            raise DataError(f"reward {r.spec!r} returned {got} values for {n} completions: it must return one float (or None) per completion")
        try:
            values = [None if v is None else float(v) for v in values]
        except (TypeError, ValueError):
            raise DataError(f"reward {r.spec!r} returned a value that is not a number: return floats (or None where it does not apply)") from None
        present = [v for v in values if v is not None]
        if not present and getattr(r.fn, "partial", False):  # an environment's scorer, and none of its rows in this batch
            continue
        if not present:
            raise DataError(f"reward {r.spec!r} returned only None for {n} completions: return a float for at least one, or drop it from --reward")
        if any(math.isnan(v) or math.isinf(v) for v in present):
            raise DataError(f"reward {r.spec!r} returned NaN or infinity: fix the reward function")
        total = [t if v is None else t + r.weight * v for t, v in zip(total, values)]
        means[r.spec] = sum(present) / len(present)
    return total, means
