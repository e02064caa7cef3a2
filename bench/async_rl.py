"""Asynchronous GRPO through the bucket, measured against synchronous GRPO on the same machine.

    .venv/bin/python bench/async_rl.py [--steps 60] [--repeats 1] [--seed-steps 300] [--workers 1,2,4]

Setup (bench/rl_paths.py's): a one-level mini-mixtral run whose path p00 learns every arithmetic
family by SFT on worked solutions (the cold start), upcycled into 4 experts; each family routed
to one path (add p00, sub p01, mul p02, word p03).

1. What a rollout machine buys (the model of adding a CPU node): synchronous GRPO on p00 pinned to
   one core (`paths train --mode grpo` sampling its own rollouts, one thread), against the same
   trainer pinned to that core with `--rollouts store --max-async 2` fed by 1, 2 or 4 `paths
   rollout` workers pinned together to the other core (one thread each). Each arm trains the same
   steps from the same seed model with the held-out reward (greedy, --eval-prompts 64) every
   --eval-every 10 steps, and the seed model's own held-out reward is printed beside: wall-clock
   to the held-out reward every arm reaches (goal: 1 worker >= 1.5x sync), completions trained on
   per second, the trainer's own steps (no worker batch within rollout_wait), the mean policy lag
   and the stale batches; 2 and 4 workers on the one core show where it saturates. An asynchronous
   arm's wall-clock ends when its trainer exits (its workers stop at their next look). One run of
   an arm moves +-10% between runs on a 2-core machine: `--repeats N` runs every arm N times, in
   alternating order (sync first, then last), each from a fresh copy of the seed model and round
   r with `seed=r` (the sync arm is deterministic: its rounds would otherwise repeat one
   trajectory), and prints the medians, the ratio of the median walls, each round's ratio and the
   held-out curves (medians of the rounds). Printed
   beside the sync arm: the share of groups without signal, whose rows no step computes
   (grpo.plan_micro_batches), so the sampling share and the bound move with the reward.
2. int8 vs fp32 rollout workers: tokens/s of `paths rollout --dtype int8` and `fp32` from the same
   published policy, alternating, and the share of tokens the trainer masks (icepop) in one step
   on each's batches; then the same comparison by model width (mini, small and bench-mixtral,
   randomly initialised: a worker's sampling and log-probs of one 64-row chunk, and the share of
   int8's tokens the fp32 learner masks). `--only-int8` runs just that.
SAPO against silo, over several seeds, is bench/rl_paths.py's.
Appended to bench/out/async_rl.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from rl_paths import FAMILIES, PROMPTS, REWARDS, admitted, env, finish, metrics, paths_cmd, sets, sft_seed  # noqa: E402


def new_run(work: str, name: str, tasks: str, seed_dir: str) -> str:
    run = os.path.join(work, name)
    families = os.path.join(work, "families.json")
    json.dump(FAMILIES, open(families, "w"))
    paths_cmd("upcycle", run, "--from", seed_dir, "--experts", "4", "--top-k", "2")
    paths_cmd("decompose", run, "--levels", "1")
    paths_cmd("shard", run, "--dataset", "rl", "--input", tasks, *PROMPTS, "--router", "domain", "--domain-field", "family", "--domain-map", families)
    return run


def trainer_args(run: str, path: str, steps: int, batch: int, lr: float, *extra: str, store: bool = True) -> list[str]:
    args = ["train", run, "--path", path, "--mode", "grpo", "--dataset", "rl", *REWARDS, "--steps", str(steps), "--checkpoint-every", "0", "--no-progress", *sets(batch, lr, *extra)]
    return args + (["--rollouts", "store", "--max-async", "2", "--set", "rollout_dtypes=fp32,bf16,int8"] if store else [])  # int8 workers are measured here


TRAINER_CPUS, WORKER_CPUS = {0}, {1}  # one core the trainer's, the other the rollout machine's


def async_arm(work: str, run: str, path: str, steps: int, batch: int, lr: float, workers: int, *extra: str, sampling: tuple[str, ...] = (), dtype: str = "fp32", tag: str = "") -> tuple[float, float]:
    """A trainer pinned to TRAINER_CPUS and `workers` rollout workers pinned together to
    WORKER_CPUS, each its own one-thread process; (the clock's start, wall seconds): the claim and
    the workers' keys come before it, as the sync arm's claim does. `sampling`: settings the
    trainer and its workers must agree on (max_new_tokens)."""
    paths_cmd("claim", run, "--path", path, "--worker", f"trainer-{path}{tag}", env=env(f"t-{path}{tag}", work, 1))
    keys = [admitted(work, run, f"cpu-{w}{tag}") for w in range(workers)]  # before the clock starts
    t0 = time.time()
    procs = [("trainer", paths_cmd(*trainer_args(run, path, steps, batch, lr, *extra, *sampling), env=env(f"t-{path}{tag}", work, 1), wait=False, cpus=TRAINER_CPUS))]
    for w in range(workers):
        procs.append((f"worker {w}", paths_cmd("rollout", run, "--path", path, "--dataset", "rl", "--key", keys[w], "--dtype", dtype, "--batches", str(10 * steps), *REWARDS,
                                               *sets(batch, lr, *sampling), "--no-progress", env=env(f"w-{path}-{w}{tag}", work, 1), wait=False, cpus=WORKER_CPUS)))
    finish(procs[:1])
    wall = time.time() - t0  # the trainer's: its model is final when it exits (workers stop at their next look at the path)
    finish(procs[1:])
    return t0, wall


def plain_steps(records: list[dict]) -> list[tuple[dict, float]]:
    """(metrics, seconds) of every step without a held-out evaluation (from the timestamps)."""
    return [(b, b["time"] - a["time"]) for a, b in zip(records, records[1:]) if "heldout_reward" not in b]


def reached(records: list[dict], target: float, t0: float) -> float | None:
    """Seconds from t0 to the first held-out reward >= target."""
    for m in records:
        if m.get("heldout_reward", -1) >= target:
            return m["time"] - t0
    return None


def seed_heldout(run: str, seed_dir: str, prompts: int, max_new_tokens: int) -> float:
    """The seed model's held-out reward, on the prompts and the greedy decoding every arm's
    evaluations use: where the arms start from (a target near it says little)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paths.work.rewards import load_reward
    from paths.work.sampling import evaluate
    from sharding.dataset import read_prompts
    from storage.layout import open_run

    records = read_prompts(open_run(run), "rl", "p00", "heldout")[:prompts]
    model = AutoModelForCausalLM.from_pretrained(seed_dir, dtype=torch.float32).eval()
    rewards = [load_reward(spec) for spec in REWARDS[1::2]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the arms' trainers evaluate (one thread each)
    try:
        return float(evaluate(model, AutoTokenizer.from_pretrained(seed_dir), records, rewards, max_new_tokens)["reward"])
    finally:
        torch.set_num_threads(threads)


def int8_by_size(presets: list[str], threads: int, prompts: int = 8, prompt_len: int = 24) -> dict[str, dict]:
    """A rollout worker's arithmetic on one chunk of 64 rows (8 completions of 32 tokens for each
    of 8 prompts with the KV-cached sampler, then the behaviour log-probs of the chunk) in fp32
    and int8, on randomly initialised presets of growing width (where matrix multiplies dominate,
    int8 pays), and the share of int8's tokens the fp32 learner would mask."""
    import torch

    from paths.base import build_model, load_spec, preset_path
    from paths.train_config import load_config
    from paths.work.grpo import logprobs_in_chunks, mismatch_keep
    from paths.work.quantize import int8_copy
    from paths.work.sampling import generate

    torch.set_num_threads(threads)
    cfg = load_config(mode="grpo")  # icepop's default band
    out = {}
    for name in presets:
        fp32 = build_model(load_spec(preset_path(name), name), seed=0).float().eval()
        models = {"fp32": fp32, "int8": int8_copy(fp32).eval()}
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, fp32.config.vocab_size, (prompts, prompt_len), generator=g)
        mask = torch.ones_like(ids)
        best, behaviour = {}, {}
        for _ in range(3):
            for dtype, m in models.items():
                torch.manual_seed(0)
                t0 = time.perf_counter()
                comp = generate(m, ids, mask, 32, 1.0, 1.0, eos_id=-1, pad_id=0, repeats=8)  # no EOS: every row writes 32 tokens
                full = torch.cat([ids.repeat_interleave(8, 0), comp], 1)
                behaviour[dtype] = (full, logprobs_in_chunks(m, full, torch.ones_like(full), prompt_len, 1.0, len(full)))
                best[dtype] = min(best.get(dtype, 1e9), time.perf_counter() - t0)
        full, lp_int8 = behaviour["int8"]  # the share of int8's tokens the fp32 learner masks
        masked = 1 - float(mismatch_keep(logprobs_in_chunks(fp32, full, torch.ones_like(full), prompt_len, 1.0, len(full)), lp_int8, cfg).mean())
        tokens = prompts * 8 * 32
        params = sum(p.numel() for p in fp32.parameters())
        out[name] = {"parameters": params, "hidden": fp32.config.hidden_size, "tokens_per_s": {k: tokens / v for k, v in best.items()}, "int8_speedup": best["fp32"] / best["int8"],
                     "int8_masked_share": masked}
        print(f"   {name} (hidden {fp32.config.hidden_size}, {params / 1e6:.1f}M parameters): fp32 {tokens / best['fp32']:.0f} tokens/s, int8 {tokens / best['int8']:.0f} "
              f"({best['fp32'] / best['int8']:.2f}x), int8 tokens masked by the fp32 learner {masked:.4f}", flush=True)
    return out


def arm_row(name: str, arm: dict, target: float, completions: int, batch: int) -> dict:
    """One run of one arm: wall-clock, time to the target held-out reward, completions/s, the
    median step (without evaluations), and for sync the share of its steps spent sampling (what a
    rollout machine can take off), for async the trainer's own steps, lag, stale and masked."""
    ms = arm["metrics"]
    row = {"wall_s": arm["wall_s"], "to_target_s": reached(ms, target, arm["t0"]), "completions_per_s": completions / arm["wall_s"],
           "heldout": [m["heldout_reward"] for m in ms if "heldout_reward" in m]}
    plain = plain_steps(ms)
    row["median_step_s"] = statistics.median(d for _, d in plain)
    if name == "sync":  # a synchronous step samples, then trains: what a rollout machine can take off it
        row["sampling_share"] = sum(batch * 8 / m["completions_per_s"] for m, _ in plain) / sum(d for _, d in plain)
        row["completion_length"] = statistics.mean(m["completion_length"] for m in ms)
        row["speedup_bound"] = 1 / (1 - row["sampling_share"])
    else:
        row |= {"own_steps": sum(m["own_batches"] for m in ms), "policy_lag": sum(m["policy_lag"] for m in ms) / len(ms),
                "stale_batches": sum(m.get("stale_batches", 0) for m in ms), "mismatch_masked": sum(m["mismatch_masked"] for m in ms) / len(ms)}
    row["zero_variance_groups"] = statistics.mean(m["zero_variance_groups"] for m in ms)  # their rows are not computed (grpo.plan_micro_batches)
    row["rows_computed"] = statistics.mean(m["rows_computed"] for m in ms)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "async_rl"))
    ap.add_argument("--prompts", type=int, default=3200)
    ap.add_argument("--seed-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=60, help="GRPO steps of every arm of the rollout-machine comparison")
    ap.add_argument("--workers", default="1,2,4", help="rollout worker counts sharing the second core")
    ap.add_argument("--repeats", type=int, default=1, help="alternating rounds of every arm (medians reported; a run moves +-10%% between runs here)")
    ap.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations (greedy, --eval-prompts prompts), in every arm's own clock")
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--int8-presets", default="mini-mixtral,small-mixtral,bench-mixtral", help="presets of the int8-by-width measurement (empty: skip it)")
    ap.add_argument("--only-int8", action="store_true", help="run only the int8-by-width measurement")
    ap.add_argument("--levels", default="1,2", help="arithmetic steps of the tasks beyond the first (gen-tasks --levels): 3 gives worked solutions about twice as long")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="completion budget of trainers and workers (48-64 for --levels 3)")
    a = ap.parse_args()
    widths = [p for p in a.int8_presets.split(",") if p]
    workers = [int(k) for k in a.workers.split(",") if k]
    if a.only_int8:
        print("int8 vs fp32, a rollout worker's arithmetic by model width (2 threads):")
        print(json.dumps(int8_by_size(widths, threads=2)))
        return
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench/async_rl.py pins the trainer and the rollout workers to two different cores: run it where two are free")
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    out: dict = {"at": time.time(), "args": vars(a)}
    tasks, seed_dir = sft_seed(a.work, a.prompts, a.seed_steps, levels=a.levels, seq_len=96 if a.max_new_tokens <= 32 else 128)

    # 1. what a rollout machine buys: sync on one core, against 1, 2, 4 workers on the other;
    # --repeats alternating rounds (sync first, then last), each arm a fresh run from the seed
    held, sampling = [f"eval_every={a.eval_every}", f"eval_prompts={a.eval_prompts}"], (f"max_new_tokens={a.max_new_tokens}",)
    others = [str(k) for k in workers]
    arms: dict[str, list[dict]] = {"sync": [], **{k: [] for k in others}}
    for r in range(a.repeats):
        for name in (["sync", *others] if r % 2 == 0 else [*others, "sync"]):
            run = new_run(a.work, f"{'sync' if name == 'sync' else 'async-' + name}-r{r}", tasks, seed_dir)
            if name == "sync":
                paths_cmd("claim", run, "--path", "p00", "--worker", "sync", env=env(f"sync-{r}", a.work, 1))
                t0 = time.time()
                paths_cmd(*trainer_args(run, "p00", a.steps, a.batch, a.lr, *held, f"seed={r}", *sampling, store=False), env=env(f"sync-{r}", a.work, 1), cpus=TRAINER_CPUS)
                wall = time.time() - t0
            else:
                t0, wall = async_arm(a.work, run, "p00", a.steps, a.batch, a.lr, int(name), *held, "rollout_wait=120", f"seed={r}", sampling=sampling, tag=f"-{name}-r{r}")
            arms[name].append({"wall_s": wall, "t0": t0, "metrics": metrics(run, "p00"), "run": run})
    best = lambda ms: max(m["heldout_reward"] for m in ms if "heldout_reward" in m)  # noqa: E731
    target = min(best(one["metrics"]) for runs in arms.values() for one in runs)
    completions = a.steps * a.batch * 8
    machine = {"steps": a.steps, "repeats": a.repeats, "target_heldout": target, "seed_heldout": seed_heldout(arms["sync"][0]["run"], seed_dir, a.eval_prompts, a.max_new_tokens)}
    for name, runs in arms.items():
        rows = [arm_row(name, one, target, completions, a.batch) for one in runs]
        row = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k not in ("heldout", "to_target_s")}  # medians over the repeats
        reached_in = [r["to_target_s"] for r in rows if r["to_target_s"] is not None]
        row |= {"to_target_s": statistics.median(reached_in) if reached_in else None, "runs": rows}
        machine[name] = row
    for k in workers:
        m, sy = machine[str(k)], machine["sync"]
        m["speedup_to_target"] = sy["to_target_s"] / m["to_target_s"] if sy["to_target_s"] and m["to_target_s"] else None
        m["speedup_throughput"] = sy["wall_s"] / m["wall_s"]  # the ratio of the medians
        m["pair_speedups"] = [s["wall_s"] / w["wall_s"] for s, w in zip(sy["runs"], m["runs"])]
        m["speedup_step"] = sy["median_step_s"] / m["median_step_s"]
    out["rollout_machine"] = machine

    # 2. int8 vs fp32 workers from one published policy
    from paths.train_config import load_config
    from paths.work.rewards import load_reward
    from paths.work.rollouts import publish, rollout_worker, set_open
    from storage.layout import open_run

    q_run = new_run(a.work, "int8", tasks, seed_dir)
    run = open_run(q_run)
    set_open(run, True)  # one process plays every worker: unsigned batches
    from transformers import AutoModelForCausalLM

    from paths.models import materialize

    materialize(run, "p00", os.path.join(a.work, "int8-p00"))
    publish(run, "p00", 0, AutoModelForCausalLM.from_pretrained(os.path.join(a.work, "int8-p00")), "00" * 32, max_async=100, step=0)
    cfg = load_config(sets=["group_size=8", "max_new_tokens=32", f"batch_size={a.batch}"], mode="grpo")
    rewards = [load_reward("math_answer"), load_reward("format=0.2")]
    rates: dict[str, list[float]] = {"fp32": [], "int8": []}
    for _ in range(3):
        for dtype in ("fp32", "int8"):
            rates[dtype].append(rollout_worker(run, "p00", "rl", cfg, rewards, worker=f"q-{dtype}", dtype=dtype, batches=2)["tokens_per_s"])
    masked = {}
    for dtype in ("fp32", "int8"):
        copy = os.path.join(a.work, f"int8-{dtype}")
        shutil.copytree(q_run, copy)
        r = open_run(copy)
        r.store.delete_prefix(f"rollouts/p00/batches/q-{'int8' if dtype == 'fp32' else 'fp32'}")  # only this dtype's batches
        from paths.work.train import train

        train(r, "p00", "grpo", "rl", load_config(sets=["group_size=8", "max_new_tokens=32", f"batch_size={a.batch}", "rollouts=store", "max_async=100", "rollout_wait=0", f"lr={a.lr}", "rollout_dtypes=fp32,bf16,int8",
                                                       "checkpoint_every=0"], steps=1, mode="grpo"), None, show_progress=False, rewards=["math_answer", "format=0.2"])
        masked[dtype] = metrics(copy, "p00")[0]["mismatch_masked"]
    out["int8_vs_fp32"] = {"tokens_per_s": {k: sorted(v)[len(v) // 2] for k, v in rates.items()}, "all": rates, "masked_share_step1": masked,
                           "by_width": int8_by_size(widths, threads=2)}

    # the figures
    sy = machine["sync"]
    secs = lambda x: "never" if x is None else f"{x:.0f}s"  # noqa: E731
    times = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    print(f"\n1. what a rollout machine buys (p00, {a.steps} steps x {a.batch} prompts x 8; trainer on core 0, workers on core 1, one thread each; "
          f"medians of {a.repeats} alternating run{'s' if a.repeats > 1 else ''}); to held-out reward {target:.3f} (the seed's {machine['seed_heldout']:.3f}):")
    print(f"   sync, one core: {sy['wall_s']:.0f}s ({sy['completions_per_s']:.1f} completions/s of {sy['completion_length']:.0f} tokens; a step {sy['median_step_s']:.2f}s, {sy['sampling_share']:.0%} of it sampling: "
          f"a rollout machine can buy at most {sy['speedup_bound']:.2f}x), to target {secs(sy['to_target_s'])}; "
          f"{sy['zero_variance_groups']:.0%} of groups without signal, {sy['rows_computed']:.0%} of rows computed")
    for k in workers:
        m = machine[str(k)]
        print(f"   async + {k} worker{'s' if k > 1 else ''} on the other core: {m['wall_s']:.0f}s ({m['completions_per_s']:.1f}/s, {m['speedup_throughput']:.2f}x, each pair "
              + ", ".join(f"{x:.2f}x" for x in m["pair_speedups"]) + f"; a step {m['median_step_s']:.2f}s, {m['speedup_step']:.2f}x), to target {secs(m['to_target_s'])} "
              f"({times(m['speedup_to_target'])}; goal >= 1.5 with 1 worker); own steps {m['own_steps']:.0f}, lag {m['policy_lag']:.2f}, stale {m['stale_batches']:.0f}, masked {m['mismatch_masked']:.4f}, "
              f"{m['zero_variance_groups']:.0%} of groups without signal")
    curve = lambda runs: [round(statistics.median(xs), 3) for xs in zip(*(r["heldout"] for r in runs))]  # noqa: E731
    print(f"   held-out reward every {a.eval_every} steps (median of the rounds): sync {curve(sy['runs'])}; "
          + "; ".join(f"{k} worker{'s' if k > 1 else ''} {curve(machine[str(k)]['runs'])}" for k in workers))
    q = out["int8_vs_fp32"]
    print(f"2. rollout tokens/s: int8 {q['tokens_per_s']['int8']:.0f}, fp32 {q['tokens_per_s']['fp32']:.0f} ({q['tokens_per_s']['int8'] / q['tokens_per_s']['fp32']:.2f}x); "
          f"tokens masked at step 1: int8 {masked['int8']:.4f}, fp32 {masked['fp32']:.4f}; by width: "
          + ", ".join(f"{k} ({v['parameters'] / 1e6:.1f}M) {v['int8_speedup']:.2f}x" for k, v in q["by_width"].items()))
    print(f"reproduce: .venv/bin/python bench/async_rl.py --steps {a.steps} --repeats {a.repeats} --seed-steps {a.seed_steps} --prompts {a.prompts} --workers {a.workers} --levels {a.levels} --max-new-tokens {a.max_new_tokens}"
          f" --eval-every {a.eval_every} --eval-prompts {a.eval_prompts}"
          f" --int8-presets '{a.int8_presets}'")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "async_rl.jsonl"), "a") as f:
        f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
