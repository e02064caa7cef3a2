"""Runs and corpora for the sharding tests: a tiny Mixtral decomposed into paths, and JSONL."""

from __future__ import annotations

import json
import os

import pytest

from storage.layout import Run, open_run

DOMAINS = ("code", "math", "prose")


def make_run(url: str, tokenizer_dir: str, levels: int, storage_options: dict | None = None) -> Run:
    """A tiny Mixtral run (4 experts, 4 layers) decomposed with `levels` levels."""
    from paths.prepare.init import init_run
    from paths.prepare.decompose import decompose

    init_run(url, preset="tiny-mixtral", tokenizer_dir=tokenizer_dir, seed=1, storage_options=storage_options)
    run = open_run(url, storage_options)
    decompose(run, levels)
    return run


def docs(n: int, start: int = 0) -> list[dict]:
    """Documents of three domains, with unicode, varied lengths and stable ids."""
    out = []
    for i in range(start, start + n):
        domain = DOMAINS[i % 3]
        body = {
            "code": f"def f{i}(x):\n    return x * {i} + {i % 7}  # ünïcode ✓\n",
            "math": f"Problem: compute {i} + {i % 13}.\nAnswer: {i + i % 13}\n",
            "prose": f"Paragraph {i}: the quick brown fox — naïve café — jumps {i % 5} times.\n",
        }[domain]
        out.append({"id": f"d{i}", "domain": domain, "text": body * (1 + i % 4)})
    return out


def write_jsonl(path: str, rows: list[dict]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


@pytest.fixture
def run2(tmp_path, tokenizer_dir) -> Run:
    """16 paths: 2 levels x 4 experts."""
    return make_run(str(tmp_path / "run"), tokenizer_dir, 2)


@pytest.fixture
def corpus(tmp_path) -> list[str]:
    """Three JSONL files of 120 documents each."""
    return [write_jsonl(str(tmp_path / "in" / f"part{k}.jsonl"), docs(120, 120 * k)) for k in range(3)]
