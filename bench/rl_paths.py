"""The mission's question, measured: does GRPO per path, composed back into one MoE, beat one dense
model of path size GRPO-trained on everything with the same rollouts?

    .venv/bin/python bench/rl_paths.py [--steps 60] [--seed-steps 500] [--workers 2]

1. Seed: a one-level run of mini-mixtral; path p00 learns all four arithmetic families (add, sub,
   mul, word problems; `paths gen-tasks --families add,sub,mul,word`) by SFT on worked solutions
   (the cold start), then is upcycled into the experiment's base: 4 experts, each the seed's MLP.
2. The families are routed as domains to the 4 paths (add -> p00, sub -> p01, mul -> p02,
   word -> p03) and the arms get the same rollouts (steps x batch x group):
   (a) paths: each path GRPO-trained on its own family by its own worker process
       (`paths claim --path P && paths train --mode grpo`, `--workers` at a time), then composed:
       `--router keep` (the upcycled router) and `--router domain-embed` (FlexOlmo: each row from
       its path's own hidden states of its family's documents);
   (b) dense: one model of path size (the seed) GRPO-trained on all families for 4x the steps;
   (c) the base: the seed itself.
3. Held-out math_answer accuracy (greedy) per family for each; the composed MoEs route per token.
   Printed as a table with the commands that ran; appended to bench/out/rl_paths.jsonl.
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

FAMILIES = {"add": "p00", "sub": "p01", "mul": "p02", "word": "p03"}
PROMPTS = ["--kind", "prompts", "--text-field", "prompt", "--id-field", "id", "--holdout", "0.15"]
REWARDS = ["--reward", "math_answer", "--reward", "format=0.2"]


def paths_cmd(*argv: str, env: dict | None = None, wait: bool = True):
    """`paths ARGV` in its own process (as a worker would run it); stdout, or the process."""
    cmd = [sys.executable, "-m", "cli.main", *argv]
    print("$ paths " + " ".join(argv), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"`paths {' '.join(argv)}` failed ({proc.returncode}):\n{err[-3000:]}")
    return out


def finish(procs: list[tuple[str, subprocess.Popen]]) -> None:
    for name, proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"worker {name} failed ({proc.returncode}):\n{err[-3000:]}")


def grpo_args(run: str, dataset: str, steps: int, a) -> list[str]:
    return ["train", run, "--mode", "grpo", "--dataset", dataset, *REWARDS, "--steps", str(steps), "--checkpoint-every", "0", "--no-progress",
            "--set", f"batch_size={a.batch}", "--set", "group_size=8", "--set", "max_new_tokens=32", "--set", "warmup_steps=2", "--set", f"lr={a.lr}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "rl_paths"))
    ap.add_argument("--preset", default="mini-mixtral")
    ap.add_argument("--prompts", type=int, default=3200)
    ap.add_argument("--seed-steps", type=int, default=500)
    ap.add_argument("--steps", type=int, default=60, help="GRPO steps per path (the dense model takes 4x)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--workers", type=int, default=2, help="path workers running at once")
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    t0 = time.perf_counter()
    tasks, docs = os.path.join(a.work, "tasks.jsonl"), os.path.join(a.work, "docs.jsonl")
    seed_run, run, dense_run = (os.path.join(a.work, n) for n in ("seed", "run", "dense"))
    home = lambda name: {"PATHS_HOME": os.path.join(a.work, "home", name), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // a.workers))}  # noqa: E731
    families = os.path.join(a.work, "families.json")
    json.dump(FAMILIES, open(families, "w"))
    all_to = lambda p: json.dump({f: p for f in FAMILIES}, open(os.path.join(a.work, f"all-{p}.json"), "w")) or os.path.join(a.work, f"all-{p}.json")  # noqa: E731

    # 1. the seed: SFT cold start on every family, upcycled into the base of the experiment
    paths_cmd("gen-tasks", "arithmetic", "--n", str(a.prompts), "--levels", "1,2", "--families", ",".join(FAMILIES), "--max-operand", "9", "--out", tasks)
    with open(tasks) as f, open(docs, "w") as out:  # the same problems as documents, for domain-embed routers
        for line in f:
            r = json.loads(line)
            out.write(json.dumps({"id": r["id"], "family": r["family"], "text": r["prompt"] + r["solution"]}) + "\n")
    paths_cmd("init", seed_run, "--preset", a.preset)
    paths_cmd("decompose", seed_run, "--levels", "1")
    paths_cmd("shard", seed_run, "--dataset", "sft", "--input", tasks, *PROMPTS, "--answer-field", "solution", "--router", "domain", "--domain-field", "family", "--domain-map", all_to("p00"))
    paths_cmd("claim", seed_run, "--path", "p00", env=home("seed"))
    paths_cmd("train", seed_run, "--mode", "sft", "--dataset", "sft", "--steps", str(a.seed_steps), "--checkpoint-every", "0", "--no-progress",
              "--set", "seq_len=96", "--set", "batch_size=16", "--set", "warmup_steps=10", "--set", "lr=3e-3", "--set", "weight_decay=0", env=home("seed"))
    seed_dir = os.path.join(a.work, "seed-p00")
    paths_cmd("materialize", seed_run, "--path", "p00", "--final", "--out", seed_dir)
    for r in (run, dense_run):
        paths_cmd("upcycle", r, "--from", seed_dir, "--experts", "4", "--top-k", "2")
        paths_cmd("decompose", r, "--levels", "1")
    paths_cmd("shard", run, "--dataset", "rl", "--input", tasks, *PROMPTS, "--router", "domain", "--domain-field", "family", "--domain-map", families)
    paths_cmd("shard", run, "--dataset", "docs", "--input", docs, "--id-field", "id", "--router", "domain", "--domain-field", "family", "--domain-map", families, "--holdout", "0.15")
    paths_cmd("shard", dense_run, "--dataset", "rl", "--input", tasks, *PROMPTS, "--router", "domain", "--domain-field", "family", "--domain-map", all_to("p00"))
    t_seed = time.perf_counter() - t0

    # 2a. one worker process per path, each on its own family
    t1 = time.perf_counter()
    pending = list(FAMILIES.items())
    while pending:
        batch, pending = pending[: a.workers], pending[a.workers :]
        procs = []
        for family, pid in batch:
            paths_cmd("claim", run, "--path", pid, "--worker", f"worker-{family}", env=home(family))
            procs.append((family, paths_cmd(*grpo_args(run, "rl", a.steps, a), "--path", pid, env=home(family), wait=False)))
        finish(procs)
    t_paths = time.perf_counter() - t1
    paths_cmd("compose", run, "--into", "moe", "--name", "keep")
    paths_cmd("compose", run, "--into", "moe", "--name", "domain-embed", "--router", "domain-embed", "--router-data", "docs", "--router-docs", "64")
    # 2b. the dense model: one path, every family, 4x the steps (the same rollouts in total)
    t2 = time.perf_counter()
    paths_cmd("claim", dense_run, "--path", "p00", "--worker", "dense", env=home("dense"))
    paths_cmd(*grpo_args(dense_run, "rl", 4 * a.steps, a), "--path", "p00", env={**home("dense"), "OMP_NUM_THREADS": str(os.cpu_count() or 1)})
    t_dense = time.perf_counter() - t2
    dense_dir = os.path.join(a.work, "dense-p00")
    paths_cmd("materialize", dense_run, "--path", "p00", "--final", "--out", dense_dir)

    # 3. held-out accuracy per family
    models = ["base", *(f"path:{p}" for p in FAMILIES.values()), "composed:keep", "composed:domain-embed", f"hf:{dense_dir}"]
    out = paths_cmd("eval", run, "--dataset", "rl", *(x for m in models for x in ("--model", m)), "--json")
    result = json.loads(out)
    table = result["table"]
    names = {"base": "(c) base: the seed (SFT cold start)", f"hf:{dense_dir}": "(b) dense: one path, all families", "composed:keep": "(a) paths composed, router keep",
             "composed:domain-embed": "(a) paths composed, router domain-embed", **{f"path:{p}": f"    path {p} alone (trained on {f})" for f, p in FAMILIES.items()}}
    print(f"\nheld-out math_answer accuracy (greedy) per family; {a.steps} GRPO steps per path x {a.batch} prompts x G=8, the dense model {4 * a.steps} steps")
    print(f"{'model':44s}" + "".join(f"{f:>8s}" for f in FAMILIES) + f"{'overall':>9s}")
    for m in models:
        row = table[m]
        print(f"{names[m]:44s}" + "".join(f"{row[p]:8.3f}" for p in FAMILIES.values()) + f"{row['overall']:9.3f}")
    print(f"seed {t_seed:.0f}s, paths {t_paths:.0f}s ({a.workers} workers at once), dense {t_dense:.0f}s; reproduce: .venv/bin/python bench/rl_paths.py --steps {a.steps} --seed-steps {a.seed_steps} --workers {a.workers}")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "rl_paths.jsonl"), "a") as f:
        f.write(json.dumps({"at": time.time(), "steps": a.steps, "seed_steps": a.seed_steps, "batch": a.batch, "lr": a.lr, "preset": a.preset,
                            "table": {names[m].strip(): table[m] for m in models}, "seconds": {"seed": t_seed, "paths": t_paths, "dense": t_dense}}) + "\n")


if __name__ == "__main__":
    main()
