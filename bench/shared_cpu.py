"""A GRPO step on a shared CPU: how much slower it gets beside busy processes, against the slowdown
its fair share of the cores would cost.

    .venv/bin/python bench/shared_cpu.py [--steps 8] [--loads 0,2,4]

The measured job is one process running the quickstart's GRPO step on mini-mixtral (16 prompts x
G=8 completions of 32 tokens, sampled with the KV-cached sampler, then one forward and backward
over them and an AdamW step), each configuration in a fresh process so the thread settings take:
sampling tokens/s and steps/s, the median of `--steps` steps after one warm-up. Beside it run
0, 2 or 4 busy processes, half a pure-Python spin loop and half another torch job (matrix
multiplies with torch's default threads). With k busy processes on c cores, a fair share leaves
the job c / (k + 1) cores: the fair slowdown is (k + 1) / c x what the job gets alone on c cores,
that is k + 1 on 2 cores when alone it uses both. The goal: within 1.5x of it.

Thread settings compared: `torch default` (as torch starts: one thread a core, OpenMP's default
wait policy), `passive` (OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep instead of spinning)
and `paths` (what the trainer and the rollout worker do: paths/threads.py, checked before each
step). Appended to bench/out/shared_cpu.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SPIN = "while True: pass"
TORCH_JOB = "import torch\na = torch.randn(384, 384)\nwhile True: a = torch.tanh(a @ a)"


def child(steps: int, settings: str) -> None:
    """One configuration, in this process: prints its figures as one JSON line."""
    import torch

    from paths.threads import Threads

    threads = Threads() if settings == "paths" else None

    from paths.base import build_model, load_spec, preset_path
    from paths.work.grpo import completion_logprobs
    from paths.work.sampling import generate

    model = build_model(load_spec(preset_path("mini-mixtral"), "mini-mixtral"), seed=0).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (16, 24), generator=g)
    mask = torch.ones_like(ids)
    sample_s, step_s = [], []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        if threads is not None:
            threads.check()  # as the trainer does before each step
        model.eval()
        comp = generate(model, ids, mask, 32, 1.0, 1.0, eos_id=-1, pad_id=0, repeats=8)  # no EOS: every row writes 32 tokens
        t1 = time.perf_counter()
        model.train()
        full = torch.cat([ids.repeat_interleave(8, 0), comp], 1)
        loss = -completion_logprobs(model, full, torch.ones_like(full), ids.shape[1], 1.0).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sample_s.append(t1 - t0)
        step_s.append(time.perf_counter() - t0)
    tokens = 16 * 8 * 32
    print(json.dumps({"threads": torch.get_num_threads(), "tokens_per_s": tokens / statistics.median(sample_s[1:]), "steps_per_s": 1 / statistics.median(step_s[1:])}))


def measure(steps: int, settings: str) -> dict:
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "PATHS_THREADS"):
        env.pop(name, None)
    if settings != "paths":
        env["PATHS_THREADS"] = "fixed"
    if settings == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    out = subprocess.run([sys.executable, __file__, "--child", settings, "--steps", str(steps)], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--loads", default="0,2,4", help="busy processes beside the job")
    ap.add_argument("--settings", default="torch default,passive,paths")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.steps, a.child)
        return
    cores = len(os.sched_getaffinity(0))
    loads = [int(x) for x in a.loads.split(",")]
    settings = a.settings.split(",")
    results: dict[str, dict[int, dict]] = {s: {} for s in settings}
    for k in loads:
        busy = [subprocess.Popen([sys.executable, "-c", SPIN if i % 2 == 0 else TORCH_JOB]) for i in range(k)]
        try:
            time.sleep(1.0)
            for s in settings:
                results[s][k] = measure(a.steps, s)
                print(f"{k} busy, {s}: {json.dumps(results[s][k])}", flush=True)
        finally:
            for p in busy:
                p.kill()
                p.wait()
    print(f"\nGRPO step on a shared CPU ({cores} cores; fair slowdown with k busy processes: (k + 1) / {cores} x alone on all cores, goal within 1.5x of it)")
    print(f"{'settings':16s}{'busy':>6s}{'threads':>9s}{'steps/s':>9s}{'tokens/s':>10s}{'slowdown':>10s}{'fair':>7s}{'/ fair':>8s}")
    best_alone = max(results[s][0]["steps_per_s"] for s in settings) if 0 in loads else None
    for s in settings:
        for k in loads:
            r = results[s][k]
            slow = best_alone / r["steps_per_s"] if best_alone else float("nan")
            fair = max(1.0, (k + 1) / cores * min(cores, results[s].get(0, r)["threads"]))
            r.update(slowdown=slow, fair=fair)
            print(f"{s:16s}{k:6d}{r['threads']:9d}{r['steps_per_s']:9.2f}{r['tokens_per_s']:10.0f}{slow:10.2f}{fair:7.1f}{slow / fair:8.2f}")
    print(f"reproduce: .venv/bin/python bench/shared_cpu.py --steps {a.steps} --loads {a.loads}")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "shared_cpu.jsonl"), "a") as f:
        f.write(json.dumps({"at": time.time(), "cores": cores, "steps": a.steps, "results": results}) + "\n")


if __name__ == "__main__":
    main()
