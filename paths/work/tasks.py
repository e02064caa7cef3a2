"""Offline RL tasks with exact answers and worked solutions: `paths gen-tasks arithmetic`.

Level L (1..5) has L operations. Families: "add", "sub", "mul" (expressions of one operator),
"mixed" (+, -, * left to right, a compound term in parentheses before *) and "word" (short
stories of adding, giving away or doubling). Records cycle through the families within each level
(so every level mixes them evenly, whatever the levels list); when "mixed" is among them, levels
3-5 leave "word" out, which with the default "mixed,word" keeps the original mix (stories only at
levels 1-2). Each record: {"id", "level", "family", "prompt", "answer", "solution"}; the prompt asks
for `Answer: <number>` (what the `format` reward checks), the solution shows one step per
operation and ends in that line (an SFT completion). Seeded: the same arguments give the same file.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any, Sequence

from paths.errors import ConfigurationError

INSTRUCTION = "Give the final answer as 'Answer: <number>'."
NAMES = ["Ada", "Ben", "Chen", "Dana", "Eli", "Fay"]
THINGS = ["apples", "books", "coins", "marbles", "stamps"]
OPERATORS = {"add": "+", "sub": "-", "mul": "*", "mixed": "+-*"}
FAMILIES = (*OPERATORS, "word")
DEFAULT_FAMILIES = ("mixed", "word")


def _apply(value: int, op: str, n: int, steps: list[str]) -> int:
    """value op n, with the step written down."""
    out = value + n if op == "+" else value - n if op == "-" else value * n
    steps.append(f"{value} {op} {n} = {out}.")
    return out


def expression(rng: random.Random, ops: int, operators: str = "+-*", max_operand: int | None = None) -> tuple[str, int, list[str]]:
    """An integer expression with `ops` operations from `operators`, its value and its steps.

    Operands: the first from 1..20, the others from 2..12; with `max_operand` N all from 1..N
    (multipliers from 2..N)."""
    value = rng.randint(1, max_operand or 20)
    text, steps = str(value), []
    for _ in range(ops):
        op = rng.choice(operators)
        n = rng.randint(2, 12) if max_operand is None else rng.randint(2 if op == "*" else 1, max_operand)
        if op == "*":
            text = f"({text}) * {n}" if " " in text and operators != "*" else f"{text} * {n}"
        else:
            text = f"{text} {op} {n}"
        value = _apply(value, op, n, steps)
    return text, value, steps


def word_problem(rng: random.Random, ops: int, max_operand: int | None = None) -> tuple[str, int, list[str]]:
    """A short story with `ops` steps of adding, giving away or doubling, its answer and steps."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    value = rng.randint(2, 15) if max_operand is None else rng.randint(1, max_operand)
    parts, steps = [f"{name} has {value} {thing}."], []
    for _ in range(ops):
        kind, n = rng.choice(["buy", "give", "double"]), rng.randint(1, max_operand or 9)
        if kind == "buy":
            parts.append(f"{name} gets {n} more.")
            value = _apply(value, "+", n, steps)
        elif kind == "give" and value > n:
            parts.append(f"{name} gives away {n}.")
            value = _apply(value, "-", n, steps)
        else:
            parts.append(f"Then the number of {thing} doubles.")
            value = _apply(value, "*", 2, steps)
    parts.append(f"How many {thing} does {name} have now?")
    return " ".join(parts), value, steps


def arithmetic(n: int, levels: list[int], seed: int = 0, families: Sequence[str] = DEFAULT_FAMILIES, max_operand: int | None = None) -> list[dict[str, Any]]:
    """n prompts with exact answers and solutions, levels cycling through `levels`, families
    cycling within each level."""
    if n < 1:
        raise ConfigurationError(f"--n must be >= 1, got {n}")
    if not levels or any(not 1 <= lv <= 5 for lv in levels):
        raise ConfigurationError(f"--levels must be numbers from 1 to 5, got {levels}")
    if max_operand is not None and max_operand < 2:
        raise ConfigurationError(f"--max-operand must be >= 2, got {max_operand}")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise ConfigurationError(f"--families {','.join(families)!r} has {'unknown ' + repr(unknown[0]) if unknown else 'no family'}: choose from {', '.join(FAMILIES)}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        cycle, slot = divmod(i, len(levels))
        level = levels[slot]
        allowed = [f for f in families if f != "word"] if level > 2 and "mixed" in families else families
        # cycle + slot, not i: with an even-length list a level always sits at the same parity of i
        family = allowed[(cycle + slot) % len(allowed)]
        if family == "word":
            question, answer, steps = word_problem(rng, level, max_operand)
        else:
            expr, answer, steps = expression(rng, level, OPERATORS[family], max_operand)
            question = f"Compute {expr}."
        out.append({
            "id": f"arith-{seed}-{i}", "level": level, "family": family, "prompt": f"{question} {INSTRUCTION}\n",
            "answer": str(answer), "solution": " ".join(steps + [f"Answer: {answer}"]),
        })
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
