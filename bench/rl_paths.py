"""The mission's question, measured: does GRPO per path, composed back into one MoE, beat one dense
model of path size GRPO-trained on everything, at equal rollouts and at equal wall-clock? And do
paths that share experience (SAPO) beat paths that keep to themselves (silo)?

    .venv/bin/python bench/rl_paths.py [--seeds 3] [--steps 40] [--sapo-steps 30] [--seed-steps 500] [--arms sync,sapo]

Every process is one thread and at most two run at once on this 2-core machine, so each has a core
to itself: a process stands for one machine, and its seconds are what that machine would take.

1. The trained seed: a one-level run of mini-mixtral whose path p00 learns all four arithmetic
   families (add, sub, mul, word problems; `paths gen-tasks --families add,sub,mul,word`) by SFT
   on worked solutions (the cold start), upcycled into the experiment's base: 4 experts, each the
   seed's MLP. The families are routed as domains to the 4 paths (add -> p00, sub -> p01,
   mul -> p02, word -> p03). Built once; every arm and every RL seed starts from copies of it.
2. For each RL seed (`--set seed=S`):
   (a) paths: each path GRPO-trained `--steps` steps on its own family by its own worker process
       (`paths claim --path P && paths train --mode grpo`), then composed with `--router keep` (the
       upcycled router) and `--router domain-embed` (FlexOlmo: each row from its path's own hidden
       states of its family's documents). Four machines run the four paths at once: the arm's
       wall-clock is its slowest path's seconds.
   (b) dense, equal rollouts: one model of path size (the seed) GRPO-trained on all families for
       4x the steps;
   (c) dense, equal wall-clock: the same, for as many steps as (b) had done when (a)'s wall-clock
       ran out (its own run, so its learning-rate schedule ends there);
   (d) SAPO and silo: the four paths trained asynchronously (`--rollouts store`), each trainer fed
       by its own rollout worker; SAPO's take 8 prompt groups a step from their worker plus
       `--external 8` from the other paths' batches, silo's 16 from their worker. Cumulative
       rollout reward (the sum over steps of each step's mean reward, over the paths), held-out
       accuracy per path and of each arm's composed MoE. Eight processes share the two cores.
3. Held-out math_answer accuracy (greedy) per family; the composed MoEs route per token. Printed as
   mean and spread (sample standard deviation) over the seeds, with each goal and its verdict;
   appended to bench/out/rl_paths.jsonl, with every seed's table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FAMILIES = {"add": "p00", "sub": "p01", "mul": "p02", "word": "p03"}
PROMPTS = ["--kind", "prompts", "--text-field", "prompt", "--id-field", "id", "--holdout", "0.15"]
REWARDS = ["--reward", "math_answer", "--reward", "format=0.2"]
SAMPLE = ["--set", "group_size=8", "--set", "max_new_tokens=32"]


def paths_cmd(*argv: str, env: dict | None = None, wait: bool = True, cpus: set[int] | None = None):
    """`paths ARGV` in its own process (as a worker would run it), pinned to `cpus` if given
    (`taskset -c`); stdout, or the process."""
    cmd = [sys.executable, "-m", "cli.main", *argv]
    print(f"$ {'taskset -c ' + ','.join(map(str, sorted(cpus))) + ' ' if cpus else ''}paths " + " ".join(argv), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
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


def sets(batch: int, lr: float, *extra: str) -> list[str]:
    return [*SAMPLE, "--set", f"batch_size={batch}", "--set", "warmup_steps=2", "--set", f"lr={lr}", *(a for e in extra for a in ("--set", e))]


def env(name: str, work: str, threads: int = 1) -> dict[str, str]:
    """A worker's own claim home and thread count: one process, one machine."""
    return {"PATHS_HOME": os.path.join(work, "home", name), "OMP_NUM_THREADS": str(threads)}


def metrics(run: str, path: str) -> list[dict]:
    with open(os.path.join(run, "work", path, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def admitted(work: str, run: str, name: str) -> str:
    """A worker key file (made once), admitted to `run` as `name`."""
    key = os.path.join(work, "keys", f"{name}.key")
    if not os.path.exists(key):
        paths_cmd("keys", "new", "--out", key)
    paths_cmd("keys", "admit", run, "--name", name, "--key", f"{key}.pub")
    return key


def grpo_args(run: str, path: str, steps: int, batch: int, lr: float, seed: int, *extra: str) -> list[str]:
    return ["train", run, "--path", path, "--mode", "grpo", "--dataset", "rl", *REWARDS, "--steps", str(steps), "--checkpoint-every", "0", "--no-progress",
            *sets(batch, lr, f"seed={seed}", *extra)]


def in_pairs(jobs: list[tuple[str, list[str], dict]], width: int, then: Callable[[dict[str, tuple[float, float]]], list[tuple[str, list[str], dict]]] | None = None) -> dict[str, tuple[float, float]]:
    """Run `paths` jobs `width` at a time (a new one starts as soon as one ends); `then(done)` may
    queue more each time a job ends. Each job's (start time, seconds)."""
    pending, running, done = list(jobs), {}, {}
    while pending or running:
        while pending and len(running) < width:
            name, argv, e = pending.pop(0)
            running[name] = (paths_cmd(*argv, env=e, wait=False), time.time())
        time.sleep(0.2)
        for name, (proc, t0) in list(running.items()):
            if proc.poll() is not None:
                finish([(name, proc)])
                done[name] = (t0, time.time() - t0)
                del running[name]
                pending += then(done) if then else []
    return done


def sft_seed(work: str, prompts: int, seed_steps: int, preset: str = "mini-mixtral", levels: str = "1,2", seq_len: int = 96) -> tuple[str, str]:
    """The SFT cold start: every family's worked solutions learnt by one dense path (tasks, seed
    folder); `levels`: steps of arithmetic a task takes beyond the first (gen-tasks --levels)."""
    tasks = os.path.join(work, "tasks.jsonl")
    seed_run, seed_dir = os.path.join(work, "seed"), os.path.join(work, "seed-p00")
    all_p00 = os.path.join(work, "all-p00.json")
    json.dump({f: "p00" for f in FAMILIES}, open(all_p00, "w"))
    paths_cmd("gen-tasks", "arithmetic", "--n", str(prompts), "--levels", levels, "--families", ",".join(FAMILIES), "--max-operand", "9", "--out", tasks)
    paths_cmd("init", seed_run, "--preset", preset)
    paths_cmd("decompose", seed_run, "--levels", "1")
    paths_cmd("shard", seed_run, "--dataset", "sft", "--input", tasks, *PROMPTS, "--answer-field", "solution", "--router", "domain", "--domain-field", "family", "--domain-map", all_p00)
    paths_cmd("claim", seed_run, "--path", "p00", env=env("seed", work, 2))
    paths_cmd("train", seed_run, "--mode", "sft", "--dataset", "sft", "--steps", str(seed_steps), "--checkpoint-every", "0", "--no-progress",
              "--set", f"seq_len={seq_len}", "--set", "batch_size=16", "--set", "warmup_steps=10", "--set", "lr=3e-3", "--set", "weight_decay=0", env=env("seed", work, 2))
    paths_cmd("materialize", seed_run, "--path", "p00", "--final", "--out", seed_dir)
    return tasks, seed_dir


def templates(work: str, a) -> tuple[str, str]:
    """The seed upcycled into 4 experts, twice: a run with each family routed to its path (and its
    documents, for domain-embed routers), and a dense one with every family on p00."""
    tasks, seed_dir = sft_seed(work, a.prompts, a.seed_steps, a.preset)
    docs, families = os.path.join(work, "docs.jsonl"), os.path.join(work, "families.json")
    json.dump(FAMILIES, open(families, "w"))
    with open(tasks) as f, open(docs, "w") as out:  # the same problems as documents
        for line in f:
            r = json.loads(line)
            out.write(json.dumps({"id": r["id"], "family": r["family"], "text": r["prompt"] + r["solution"]}) + "\n")
    run, dense = os.path.join(work, "template-paths"), os.path.join(work, "template-dense")
    for r in (run, dense):
        paths_cmd("upcycle", r, "--from", seed_dir, "--experts", "4", "--top-k", "2")
        paths_cmd("decompose", r, "--levels", "1")
    paths_cmd("shard", run, "--dataset", "rl", "--input", tasks, *PROMPTS, "--router", "domain", "--domain-field", "family", "--domain-map", families)
    paths_cmd("shard", run, "--dataset", "docs", "--input", docs, "--id-field", "id", "--router", "domain", "--domain-field", "family", "--domain-map", families, "--holdout", "0.15")
    paths_cmd("shard", dense, "--dataset", "rl", "--input", tasks, *PROMPTS, "--router", "domain", "--domain-field", "family", "--domain-map", os.path.join(work, "all-p00.json"))
    return run, dense


def copy_run(template: str, work: str, name: str) -> str:
    """A fresh run from the template (a local folder run copies whole)."""
    run = os.path.join(work, name)
    shutil.copytree(template, run)
    return run


def dense_steps_within(records: list[dict], t0: float, seconds: float) -> int:
    """Steps a run whose process started at t0 had finished `seconds` later (at least 1)."""
    return max(1, sum(1 for m in records if m["time"] - t0 <= seconds))


def sapo_arm(work: str, template: str, arm: str, seed: int, a) -> dict:
    """Four asynchronous trainers and their rollout workers, all at once; composed; evaluated."""
    batch, extra = (a.batch, []) if arm == "silo" else (a.batch // 2, [f"external={a.batch // 2}"])
    run = copy_run(template, work, f"{arm}-s{seed}")
    procs = []
    for pid in FAMILIES.values():
        home = env(f"{arm}-s{seed}-{pid}", work)
        paths_cmd("claim", run, "--path", pid, "--worker", f"{arm}-{pid}", env=home)
        procs.append((f"trainer {pid}", paths_cmd(*grpo_args(run, pid, a.sapo_steps, batch, a.lr, seed, "rollout_wait=300", *extra), "--rollouts", "store", "--max-async", "2",
                                                  env=home, wait=False)))
        procs.append((f"worker {pid}", paths_cmd("rollout", run, "--path", pid, "--dataset", "rl", "--key", admitted(work, run, f"cpu-{pid}"), "--batches", str(10 * a.sapo_steps),
                                                 *REWARDS, *sets(batch, a.lr), "--no-progress", env=env(f"w-{arm}-s{seed}-{pid}", work), wait=False)))
    t0 = time.time()
    finish(procs)
    wall = time.time() - t0
    paths_cmd("compose", run, "--into", "moe", "--name", arm)
    models = [*(f"path:{p}" for p in FAMILIES.values()), f"composed:{arm}"]
    table = json.loads(paths_cmd("eval", run, "--dataset", "rl", *(x for m in models for x in ("--model", m)), "--json"))["table"]
    curves = {pid: [m["reward_mean"] for m in metrics(run, pid)] for pid in FAMILIES.values()}
    return {"wall_s": wall, "own_family": {f: table[f"path:{p}"][p] for f, p in FAMILIES.items()}, "composed": table[f"composed:{arm}"],
            "cumulative_reward": sum(sum(c) for c in curves.values()), "stale_batches": sum(m.get("stale_batches", 0) for p in FAMILIES.values() for m in metrics(run, p))}


def spread(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "rl_paths"))
    ap.add_argument("--preset", default="mini-mixtral")
    ap.add_argument("--prompts", type=int, default=3200)
    ap.add_argument("--seed-steps", type=int, default=500)
    ap.add_argument("--seeds", type=int, default=3, help="RL seeds (each arm runs once per seed)")
    ap.add_argument("--steps", type=int, default=40, help="GRPO steps per path (the dense model takes 4x)")
    ap.add_argument("--sapo-steps", type=int, default=30, help="asynchronous steps per path of the SAPO and silo arms")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--arms", default="sync,sapo", help="sync: (a)-(c); sapo: (d); both by default (sync 19 minutes here, sapo 14)")
    a = ap.parse_args()
    arms = set(a.arms.split(","))
    if not arms or arms - {"sync", "sapo"}:
        raise SystemExit(f"--arms takes sync, sapo or both, got {a.arms!r}")
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    t_start = time.perf_counter()
    template, dense_template = templates(a.work, a)
    seeds = list(range(a.seeds))
    out: dict = {"at": time.time(), "args": vars(a), "goals": {}}
    if "sync" in arms:
        out.update(sync_arms(a, template, dense_template, seeds))
        out["goals"].update(print_sync(out, a, seeds))
    if "sapo" in arms:
        out["sapo"] = {arm: {s: sapo_arm(a.work, template, arm, s, a) for s in seeds} for arm in ("silo", "sapo")}
        out["goals"].update(print_sapo(out["sapo"], seeds))
    print(f"{time.perf_counter() - t_start:.0f} s in all; reproduce: .venv/bin/python bench/rl_paths.py --seeds {a.seeds} --steps {a.steps} "
          f"--sapo-steps {a.sapo_steps} --seed-steps {a.seed_steps} --arms {a.arms}")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "rl_paths.jsonl"), "a") as f:
        f.write(json.dumps(out) + "\n")


def sync_arms(a, template: str, dense_template: str, seeds: list[int]) -> dict:
    """(a) paths, (b) dense with the same rollouts, (c) dense at equal wall-clock; every seed's table."""
    # (a) the paths of every seed, (b) dense with the same rollouts (4x the steps), and, once a
    # seed's paths and its dense run are both done, (c): the same dense model for the steps it had
    # done in the paths' wall-clock, as its own run. One queue, two processes at a time (one core
    # each), the longest first: no core idles at a phase's end
    runs = {s: copy_run(template, a.work, f"paths-s{s}") for s in seeds}
    dense = {s: copy_run(dense_template, a.work, f"dense-s{s}") for s in seeds}
    dense_wall = {s: copy_run(dense_template, a.work, f"dense-wall-s{s}") for s in seeds}
    path_jobs = []
    for s in seeds:
        for fam, pid in FAMILIES.items():
            paths_cmd("claim", runs[s], "--path", pid, "--worker", f"worker-{fam}", env=env(f"s{s}-{fam}", a.work))
            path_jobs.append((f"s{s}-{pid}", grpo_args(runs[s], pid, a.steps, a.batch, a.lr, s), env(f"s{s}-{fam}", a.work)))
    path_jobs.sort(key=lambda job: job[0].endswith(FAMILIES["word"]), reverse=True)  # word problems' paths take the longest
    for s in seeds:
        for r, name in ((dense[s], f"dense-s{s}"), (dense_wall[s], f"dense-wall-s{s}")):
            paths_cmd("claim", r, "--path", "p00", "--worker", "dense", env=env(name, a.work))
    wall: dict[int, float] = {}
    wall_steps: dict[int, int] = {}
    def wall_run(ended: dict[str, tuple[float, float]]) -> list[tuple[str, list[str], dict]]:
        queued = []
        for s in seeds:
            parts = [f"s{s}-{p}" for p in FAMILIES.values()]
            if s in wall or f"dense-s{s}" not in ended or any(p not in ended for p in parts):
                continue
            wall[s] = max(ended[p][1] for p in parts)  # four machines at once: the slowest path
            wall_steps[s] = dense_steps_within(metrics(dense[s], "p00"), ended[f"dense-s{s}"][0], wall[s])
            queued.append((f"dense-wall-s{s}", grpo_args(dense_wall[s], "p00", wall_steps[s], a.batch, a.lr, s), env(f"dense-wall-s{s}", a.work)))
        return queued

    dense_jobs = [(f"dense-s{s}", grpo_args(dense[s], "p00", 4 * a.steps, a.batch, a.lr, s), env(f"dense-s{s}", a.work)) for s in seeds]
    seconds = in_pairs(dense_jobs + path_jobs, 2, wall_run)
    path_seconds = {k: v for k, v in seconds.items() if not k.startswith("dense")}
    dense_seconds = {k: v for k, v in seconds.items() if k.startswith("dense")}
    # held-out accuracy per family
    tables = {}
    for s in seeds:
        paths_cmd("compose", runs[s], "--into", "moe", "--name", "keep")
        paths_cmd("compose", runs[s], "--into", "moe", "--name", "domain-embed", "--router", "domain-embed", "--router-data", "docs", "--router-docs", "64")
        for r, name in ((dense[s], "dense"), (dense_wall[s], "dense-wall")):
            paths_cmd("materialize", r, "--path", "p00", "--final", "--out", os.path.join(a.work, f"{name}-s{s}-p00"))
        models = ["base", *(f"path:{p}" for p in FAMILIES.values()), "composed:keep", "composed:domain-embed",
                  f"hf:{os.path.join(a.work, f'dense-s{s}-p00')}", f"hf:{os.path.join(a.work, f'dense-wall-s{s}-p00')}"]
        table = json.loads(paths_cmd("eval", runs[s], "--dataset", "rl", *(x for m in models for x in ("--model", m)), "--json"))["table"]
        tables[s] = {"seed": table["base"], **{f"path {p}": table[f"path:{p}"] for p in FAMILIES.values()}, "composed keep": table["composed:keep"],
                     "composed domain-embed": table["composed:domain-embed"], "dense, equal rollouts": table[models[-2]], "dense, equal wall-clock": table[models[-1]]}
    return {"tables": tables, "wall_s": wall, "path_s": path_seconds, "dense_s": dense_seconds, "wall_steps": wall_steps}


def print_sync(out: dict, a, seeds: list[int]) -> dict:
    """The accuracy table, mean ± spread over the seeds, and the wall-clock goal per family."""
    tables, cols = out["tables"], [*FAMILIES, "overall"]
    key = lambda f: FAMILIES.get(f, f)  # noqa: E731
    print(f"\nheld-out math_answer accuracy (greedy), mean ± spread over {len(seeds)} RL seeds; {a.steps} GRPO steps per path x {a.batch} prompts x G=8; "
          f"dense: {4 * a.steps} steps (equal rollouts) and {', '.join(str(out['wall_steps'][s]) for s in seeds)} steps (equal wall-clock)")
    print(f"{'model':28s}" + "".join(f"{c:>16s}" for c in cols))
    for m in tables[seeds[0]]:
        print(f"{m:28s}" + "".join(f"{spread([tables[s][m][key(c)] for s in seeds]):>16s}" for c in cols))
    print(f"wall-clock of the paths (four machines, the slowest path): {spread([out['wall_s'][s] for s in seeds])} s; "
          f"dense with the same rollouts: {spread([out['dense_s'][f'dense-s{s}'][1] for s in seeds])} s")
    goals = {}
    for name in ("composed keep", "composed domain-embed"):
        wins = {c: sum(tables[s][name][key(c)] >= tables[s]["dense, equal wall-clock"][key(c)] for s in seeds) for c in cols}
        goals[f"{name} >= dense at equal wall-clock"] = wins
        print(f"goal: {name} >= dense at equal wall-clock on every family: " + ", ".join(f"{c} {w}/{len(seeds)} seeds" for c, w in wins.items()))
    return goals


def print_sapo(sapo: dict, seeds: list[int]) -> dict:
    for arm, by_seed in sapo.items():
        print(f"{arm:5s}: cumulative rollout reward {spread([v['cumulative_reward'] for v in by_seed.values()])}; own family "
              + ", ".join(f"{f} {spread([v['own_family'][f] for v in by_seed.values()])}" for f in FAMILIES)
              + f"; composed overall {spread([v['composed']['overall'] for v in by_seed.values()])}; {spread([v['wall_s'] for v in by_seed.values()])} s")
    wins = sum(sapo["sapo"][s]["cumulative_reward"] > sapo["silo"][s]["cumulative_reward"] for s in seeds)
    print(f"goal: SAPO > silo on cumulative reward: {wins}/{len(seeds)} seeds")
    return {"sapo > silo on cumulative reward": wins}

if __name__ == "__main__":
    main()
