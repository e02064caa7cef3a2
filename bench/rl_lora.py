"""GRPO with a LoRA adapter against full fine-tuning, on the quickstart's RL task, same steps.

    .venv/bin/python bench/rl_lora.py [--steps 100] [--rank 16] [--lrs 1e-3,3e-3]

Starts from the rl scenario's upcycled seed (`make quickstart` or `paths quickstart --scenario rl`
leaves it in runs/quickstart-rl; this bench copies its base and data, never its training): both
paths trained by GRPO as the scenario does (100 steps, batch 16 x group 8, lr 1e-4), once in full
and once with a rank-`--rank` adapter on attention and experts for each adapter lr in `--lrs`;
each set composed into the MoE. Printed: held-out `math_answer` accuracy (greedy, `paths eval`)
of the seed, each path and the composed MoE, and the adapter's gain as a share of full
fine-tuning's (goal >= 0.8). Appended to bench/out/rl_lora.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SETTINGS = ["batch_size=16", "group_size=8", "max_new_tokens=24", "warmup_steps=2"]
REWARDS = ["--reward", "math_answer", "--reward", "format=0.2"]


def paths(*args: str) -> str:
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "paths"), *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"paths {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def arm(source: str, work: str, name: str, steps: int, lr: float, lora: list[str]) -> dict[str, float]:
    """Copy the seed run (base, plan, data), train both paths, compose, evaluate."""
    root = os.path.join(work, name)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    for item in os.listdir(source):
        if item not in ("work", "claims", "composed", "evals", "policy", "rollouts"):
            (shutil.copytree if os.path.isdir(os.path.join(source, item)) else shutil.copy)(os.path.join(source, item), os.path.join(root, item))
    t0 = time.time()
    for p in ("p00", "p01"):
        paths("claim", root, "--path", p, "--ttl", "120", "--worker", "bench")
        paths("train", root, "--path", p, "--mode", "grpo", "--dataset", "arith", *REWARDS, "--steps", str(steps), "--checkpoint-every", "0",
              *(a for s in [*SETTINGS, f"lr={lr}"] for a in ("--set", s)), *lora, "--no-progress")
    seconds = time.time() - t0
    paths("compose", root, "--into", "moe", "--name", "rl", "--overwrite")
    out = json.loads(paths("eval", root, "--dataset", "arith", "--model", "base", "--model", "path:p00", "--model", "path:p01", "--model", "composed:rl", "--json"))
    table = out["table"]
    return {name: table[model]["overall"] for name, model in (("seed", "base"), ("p00", "path:p00"), ("p01", "path:p01"), ("composed", "composed:rl"))} | {"train_seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default=os.path.join(ROOT, "runs", "quickstart-rl"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lrs", default="1e-3,3e-3")
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "rl_lora"))
    a = ap.parse_args()
    if not os.path.exists(os.path.join(a.source, "base")):
        raise SystemExit(f"{a.source} holds no upcycled seed: run `paths quickstart --scenario rl` first")
    rows = {"full (lr 1e-4)": arm(a.source, a.work, "full", a.steps, 1e-4, [])}
    for lr in a.lrs.split(","):
        rows[f"LoRA r{a.rank} (lr {lr})"] = arm(a.source, a.work, f"lora-{lr}", a.steps, float(lr), ["--lora", str(a.rank)])
    full = rows["full (lr 1e-4)"]
    gain = (full["p00"] + full["p01"]) / 2 - full["seed"]
    print(f"\nheld-out math_answer accuracy after {a.steps} GRPO steps per path (seed {full['seed']:.3f})")
    print(f"{'arm':22} {'p00':>7} {'p01':>7} {'composed':>9} {'paths gain / full':>18} {'train s':>8}")
    for name, r in rows.items():
        share = ((r["p00"] + r["p01"]) / 2 - r["seed"]) / gain if gain else float("nan")
        print(f"{name:22} {r['p00']:>7.3f} {r['p01']:>7.3f} {r['composed']:>9.3f} {share:>18.2f} {r['train_seconds']:>8.0f}")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "rl_lora.jsonl"), "a") as f:
        f.write(json.dumps({"steps": a.steps, "rank": a.rank, "rows": rows, "at": time.time()}) + "\n")
    print(f"\nreproduce: .venv/bin/python bench/rl_lora.py --steps {a.steps} --rank {a.rank} --lrs {a.lrs}")


if __name__ == "__main__":
    main()
