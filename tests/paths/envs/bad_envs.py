"""verifiers environments that misbehave, for the bad-input tests: `load_environment` raising, and
rubrics that return NaN or None. Loaded as verifiers:tests.paths.envs.bad_envs:kind=..."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def nan_reward(completion, **kwargs) -> float:
    return float("nan")


def none_reward(completion, **kwargs):
    return None


def broken_group(completions, **kwargs) -> list[float]:
    raise RuntimeError("the judge is down")


def load_environment(kind: str = "raise") -> vf.Environment:
    if kind == "raise":
        raise RuntimeError("the task server is down\n(retry later)")
    rows = [{"question": f"{i} + 1 = ?", "answer": str(i + 1)} for i in range(8)]
    fn = {"nan": nan_reward, "none": none_reward, "group": broken_group}[kind]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[fn], weights=[1.0]))
