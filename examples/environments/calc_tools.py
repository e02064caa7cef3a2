"""A multi-turn verifiers environment with a tool: sums of two numbers, with an `add` tool.

`load_environment(n=200, eval_n=20, seed=0, max_turns=3, low=10, high=99)` (operands from low to
high); offline (the data is generated). The
model may call `add(a, b)`: the environment runs it and answers with a tool message; the episode
ends at the first model turn with no tool call, or after `max_turns` turns. Rubric: the model's
last turn ends in the sum (weight 1); a tool call that ran (weight 0.1).
`demonstrations(n, seed, low, high, direct=0.0)`: worked episodes (call the tool, then give its
result; a `direct` share answers at once, without the tool) in TRL's conversational prompt /
completion form, for a supervised warm start.
"""

from __future__ import annotations

import random
import re

import verifiers as vf
from datasets import Dataset

NUMBER = re.compile(r"-?\d+")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return int(a) + int(b)


def _pairs(n: int, rng: random.Random, low: int = 10, high: int = 99) -> list[tuple[int, int]]:
    return [(rng.randint(low, high), rng.randint(low, high)) for _ in range(n)]


def _row(a: int, b: int) -> dict:
    return {"question": f"{a} + {b} = ?", "answer": str(a + b)}


def correct(completion, answer, **kwargs) -> float:
    """1 when the model's last turn ends in the sum."""
    last = next((m.content for m in reversed(completion) if m.role == "assistant"), "") or ""
    found = NUMBER.findall(last)
    return 1.0 if found and found[-1] == answer else 0.0


def used_tool(completion, **kwargs) -> float:
    """1 when a tool answered with a number (a call that ran)."""
    return 1.0 if any(m.role == "tool" and NUMBER.fullmatch((m.content or "").strip()) for m in completion) else 0.0


def load_environment(n: int = 200, eval_n: int = 20, seed: int = 0, max_turns: int = 3, low: int = 10, high: int = 99) -> vf.Environment:
    rng = random.Random(seed)
    train, test = [_row(a, b) for a, b in _pairs(n, rng, low, high)], [_row(a, b) for a, b in _pairs(eval_n, rng, low, high)]
    rubric = vf.Rubric(funcs=[correct, used_tool], weights=[1.0, 0.1])
    return vf.ToolEnv(dataset=Dataset.from_list(train), eval_dataset=Dataset.from_list(test), tools=[add], rubric=rubric, max_turns=max_turns)


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "description": "the first integer"}, "b": {"type": "integer", "description": "the second integer"}},
    "required": ["a", "b"]}}}]


def demonstrations(n: int = 200, seed: int = 1, low: int = 10, high: int = 99, direct: float = 0.0) -> list[dict]:
    """Worked episodes: {"id", "prompt": [user], "completion": [tool call, tool result, answer], "tools"};
    the first round(direct * n) answer at once instead: [answer]."""
    out = []
    for i, (a, b) in enumerate(_pairs(n, random.Random(seed), low, high)):
        call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        used = [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": str(a + b), "tool_call_id": "call_0"}]
        out.append({"id": f"demo-{seed}-{i}", "prompt": [{"role": "user", "content": f"{a} + {b} = ?"}],
                    "completion": [*(used if i >= round(direct * n) else []), {"role": "assistant", "content": f"The sum is {a + b}."}], "tools": TOOLS})
    return out
