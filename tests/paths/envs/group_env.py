"""A single-turn verifiers environment whose rubric has a group-level reward function (it sees
every completion of one prompt at once), for the scoring tests. Loaded as
verifiers:tests.paths.envs.group_env"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def correct(completion, answer, **kwargs) -> float:
    return float(completion[-1]["content"].strip() == answer)


def shortest(completions, **kwargs) -> list[float]:
    """1 for the shortest completion(s) of the group, 0 for the others: a reward only a group can give."""
    lengths = [len(c[-1]["content"]) for c in completions]
    return [float(n == min(lengths)) for n in lengths]


def load_environment() -> vf.Environment:
    rows = [{"question": f"{i} + 1 = ?", "answer": str(i + 1)} for i in range(8)]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[correct, shortest], weights=[1.0, 0.5]))
