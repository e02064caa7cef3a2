"""A multi-domain corpus that every machine with Python has, for the quickstart and tests.

- `code`:  the standard library's top-level `.py` sources, one document per file;
- `prose`: the reference text shipped with Python (`pydoc_data.topics`), one document per topic;
- `math`:  generated arithmetic problems with worked answers (seeded, so always the same).
Written as JSONL records {"id", "domain", "text"}, one file per domain.
"""

from __future__ import annotations

import glob
import json
import os
import random
import sysconfig

DOMAINS = ("code", "math", "prose")


def code_docs(max_files: int = 400) -> list[dict[str, str]]:
    """Standard-library sources, in sorted order."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:max_files]
    out = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            out.append({"id": f"code/{os.path.basename(path)}", "domain": "code", "text": f.read()})
    return out


def prose_docs() -> list[dict[str, str]]:
    """Python's reference topics (the text `help('if')` shows)."""
    from pydoc_data.topics import topics

    return [{"id": f"prose/{name}", "domain": "prose", "text": text} for name, text in sorted(topics.items())]


def arithmetic_problem(rng: random.Random, level: int) -> tuple[str, int]:
    """A problem with `level + 1` operations on small integers, and its exact answer."""
    value = rng.randint(1, 20)
    expr = str(value)
    for _ in range(level + 1):
        op, n = rng.choice("+-*"), rng.randint(1, 12)
        expr = f"({expr} {op} {n})" if op == "*" else f"{expr} {op} {n}"
        value = value * n if op == "*" else value + n if op == "+" else value - n
    return expr, value


def math_docs(n: int = 2000, seed: int = 0) -> list[dict[str, str]]:
    """Worked arithmetic problems of graded difficulty."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        expr, value = arithmetic_problem(rng, i % 4)
        out.append({"id": f"math/{i}", "domain": "math", "text": f"Problem: compute {expr}.\nSolution: {expr} = {value}.\nAnswer: {value}"})
    return out


def write_corpus(folder: str, max_code_files: int = 400, math_problems: int = 2000) -> list[str]:
    """Write code.jsonl, math.jsonl and prose.jsonl into folder (atomically); their paths."""
    os.makedirs(folder, exist_ok=True)
    docs = {"code": code_docs(max_code_files), "math": math_docs(math_problems), "prose": prose_docs()}
    paths = []
    for domain in DOMAINS:
        path = os.path.join(folder, f"{domain}.jsonl")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for doc in docs[domain]:
                f.write(json.dumps(doc) + "\n")
        os.replace(tmp, path)
        paths.append(path)
    return paths
