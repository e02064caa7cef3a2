"""Offline RL tasks with exact answers: `paths gen-tasks arithmetic`.

Level L (1..5) has L operations: level 1-2 alternate between bare expressions and word problems,
higher levels are nested expressions with parentheses. Each record: {"id", "level", "prompt",
"answer"}; the prompt asks for the answer as `Answer: <number>` (what the `format` reward checks).
Seeded, so the same arguments give the same file.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

from paths.errors import ConfigurationError

INSTRUCTION = "Give the final answer as 'Answer: <number>'."
NAMES = ["Ada", "Ben", "Chen", "Dana", "Eli", "Fay"]
THINGS = ["apples", "books", "coins", "marbles", "stamps"]


def expression(rng: random.Random, ops: int) -> tuple[str, int]:
    """An integer expression with `ops` operations (+, -, *) and its value."""
    value = rng.randint(1, 20)
    text = str(value)
    for _ in range(ops):
        op, n = rng.choice("+-*"), rng.randint(2, 12)
        if op == "*":
            text, value = f"({text}) * {n}" if " " in text else f"{text} * {n}", value * n
        else:
            text, value = f"{text} {op} {n}", value + n if op == "+" else value - n
    return text, value


def word_problem(rng: random.Random, ops: int) -> tuple[str, int]:
    """A short story with `ops` steps of adding, giving away or doubling."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    value = rng.randint(2, 15)
    parts = [f"{name} has {value} {thing}."]
    for _ in range(ops):
        kind, n = rng.choice(["buy", "give", "double"]), rng.randint(1, 9)
        if kind == "buy":
            parts.append(f"{name} gets {n} more.")
            value += n
        elif kind == "give" and value > n:
            parts.append(f"{name} gives away {n}.")
            value -= n
        else:
            parts.append(f"Then the number of {thing} doubles.")
            value *= 2
    parts.append(f"How many {thing} does {name} have now?")
    return " ".join(parts), value


def arithmetic(n: int, levels: list[int], seed: int = 0) -> list[dict[str, Any]]:
    """n prompts with exact answers, levels cycling through `levels`."""
    if n < 1:
        raise ConfigurationError(f"--n must be >= 1, got {n}")
    if not levels or any(not 1 <= lv <= 5 for lv in levels):
        raise ConfigurationError(f"--levels must be numbers from 1 to 5, got {levels}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        level = levels[i % len(levels)]
        if level <= 2 and i % 2:
            question, answer = word_problem(rng, level)
        else:
            expr, answer = expression(rng, level)
            question = f"Compute {expr}."
        out.append({"id": f"arith-{seed}-{i}", "level": level, "prompt": f"{question} {INSTRUCTION}\n", "answer": str(answer)})
    return out


def write_jsonl(records: list[dict[str, Any]], url: str) -> None:
    """Write records to a local path (temp + rename) or any fsspec URL (one PUT)."""
    import fsspec

    body = "".join(json.dumps(r) + "\n" for r in records).encode()
    if "://" not in url:
        os.makedirs(os.path.dirname(os.path.abspath(url)), exist_ok=True)
        tmp = f"{url}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, url)
        return
    with fsspec.open(url, "wb") as f:
        f.write(body)
