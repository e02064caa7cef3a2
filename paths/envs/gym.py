"""reasoning-gym tasks: procedural prompts with exact answers, scored by the task's own `score_answer`.

`reasoning-gym:TASK[:size=N,seed=S,eval_size=M,<the task's own options>]` generates `size` train
prompts with `seed` and `eval_size` held-out prompts with another seed (reasoning-gym has no
splits). Each prompt is one user message: the task's question plus an instruction to put the final
answer in `<answer></answer>` tags (what reasoning-gym's own prompts ask, and what its scorers
read). The record keeps the entry (question, answer, metadata) in `info`, so the scorer gets
exactly what the generator made, on any machine.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from paths.envs.spec import EXTRA, EnvSpec
from paths.errors import ConfigurationError, DataError

INSTRUCTION = "Give only the final answer, inside <answer></answer>."
EVAL_SEED_OFFSET = 1_000_003  # held-out prompts come from a seed no train seed near it uses


def _gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigurationError(f"reasoning-gym tasks need the reasoning-gym package: {EXTRA}") from None
    return reasoning_gym


def rows(spec: EnvSpec) -> Iterator[dict[str, Any]]:
    """The task's train prompts, then its held-out ones (`_split: heldout`), as prompt records."""
    gym = _gym()
    args = dict(spec.args)
    size, seed, eval_size = int(args.pop("size", 500)), int(args.pop("seed", 0)), int(args.pop("eval_size", 50))
    if not spec.name:
        raise ConfigurationError("reasoning-gym needs a task: write reasoning-gym:TASK (e.g. reasoning-gym:basic_arithmetic)")
    for split, n, s in (("train", size, seed), ("heldout", eval_size, seed + EVAL_SEED_OFFSET)):
        if n <= 0:
            continue
        try:
            data = gym.create_dataset(spec.name, size=n, seed=s, **args)
        except Exception as exc:  # an unknown task or option: the library's own words, in one line
            raise ConfigurationError(f"reasoning-gym task {spec.name!r} cannot be made ({type(exc).__name__}: {' '.join(str(exc).split())}): "
                                     "check the task name and its options") from None
        for i in range(n):
            entry = data[i]
            yield {
                "prompt": [{"role": "user", "content": f"{entry['question']}\n{INSTRUCTION}"}],
                "answer": str(entry["answer"]), "id": f"{spec.name}-{split}-{seed}-{i}", "_split": split,
                "info": json.loads(json.dumps({"question": entry["question"], "answer": entry["answer"], "metadata": entry["metadata"]}, default=str)),
            }


def extract(completion: str) -> str | None:
    """The text inside the last <answer></answer> of a completion, stripped."""
    from reasoning_gym.utils import extract_answer

    return extract_answer(completion)


def score(completions: list[str], info: list[Any], **_: Any) -> list[float]:
    """Each completion's answer scored by its task's own `score_answer` (0 without answer tags)."""
    gym = _gym()
    out = []
    for completion, entry in zip(completions, info):
        entry = json.loads(entry) if isinstance(entry, str) else entry
        source = (entry or {}).get("metadata", {}).get("source_dataset") if isinstance(entry, dict) else None
        if not source:
            raise DataError("reward reasoning-gym: a prompt record has no info.metadata.source_dataset: shard the prompts from a reasoning-gym:TASK input")
        answer = extract(completion)
        out.append(0.0 if answer is None else float(gym.get_score_answer_fn(source)(answer, entry)))
    return out
