"""A single-turn verifiers environment: products of two small numbers, answered in <answer></answer>.

`load_environment(n=200, eval_n=20, seed=0, system_prompt=None)`; offline (the data is generated).
Its rubric: the answer is right (weight 1) and the tags are there (weight 0.2).
"""

from __future__ import annotations

import random
import re

import verifiers as vf
from datasets import Dataset

ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def _rows(n: int, rng: random.Random) -> list[dict]:
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        out.append({"question": f"What is {a} times {b}? Answer in <answer></answer>.", "answer": str(a * b), "info": {"a": a, "b": b}})
    return out


def correct(completion, answer, **kwargs) -> float:
    """1 when the last <answer> holds the product."""
    text = completion[-1].content if isinstance(completion, list) else completion
    found = ANSWER.findall(text or "")
    return 1.0 if found and found[-1] == answer else 0.0


def tagged(completion, **kwargs) -> float:
    """1 when the completion gives an <answer> at all."""
    text = completion[-1].content if isinstance(completion, list) else completion
    return 1.0 if ANSWER.search(text or "") else 0.0


def load_environment(n: int = 200, eval_n: int = 20, seed: int = 0, system_prompt: str | None = None) -> vf.Environment:
    rng = random.Random(seed)
    train, test = _rows(n, rng), _rows(eval_n, rng)
    rubric = vf.Rubric(funcs=[correct, tagged], weights=[1.0, 0.2])
    return vf.SingleTurnEnv(dataset=Dataset.from_list(train), eval_dataset=Dataset.from_list(test), system_prompt=system_prompt, rubric=rubric)
