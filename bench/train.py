"""`paths train --mode lm` against Hugging Face `Trainer`, checkpoint cost, and claim latency.

    .venv/bin/python bench/train.py [--steps 30] [--repeats 3] [--seq-len 256] [--batch 8] [--work bench/out/train] [--claims-only]

1. Tokens/s: ours (`paths.train.train`, with a claim and its heartbeat) and HF `Trainer` train the
   same dense path (small-mixtral preset, ~4.5M parameters) for the same steps, batch, sequence
   length and windows, with fused AdamW, warmup + cosine, clipping 1.0, fp32 on CPU, no evaluation
   and no checkpoints during the timed part. Each run is a process of its own, as a user runs
   either (`paths train` sets glibc's allocator to keep freed memory on a CPU: paths/allocator.py;
   a script calling Trainer.train() does not), with its imports made before the clock; a third
   arm runs HF Trainer after the same allocator setting. One run of each moves +-10% between runs
   on a 2-core machine, so they alternate `--repeats` times (who goes first alternating too; the
   path starts afresh each time): printed, the median tokens/s of each, the ratio of the medians
   (goal >= 1.1) for the whole `train()` call and for its step loop alone, every pair's ratio, and
   ours against HF Trainer given the same allocator.
2. Checkpoint: seconds and bytes of one committed checkpoint (model + AdamW state + state.json).
3. Claims: 16 processes claim paths of a 256-path plan on SeaweedFS until none is left, 5 races on
   fresh plans; p50 and p99 of one successful `claim()` (medians over the races, and each race's),
   and its round trips to the store (reads, conditional PUTs, listings and pages of them).
Results are appended to bench/out/train.jsonl.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PATH = "p01-02"


def build(work: str, steps: int):
    from paths.prepare.init import init_run
    from paths.prepare.decompose import decompose
    from sharding.corpus import write_corpus
    from sharding.shard import ShardOptions, shard
    from storage.layout import open_run

    url = os.path.join(work, "run")
    init_run(url, preset="small-mixtral", seed=0)
    run = open_run(url)
    decompose(run, 2)
    files = write_corpus(os.path.join(work, "corpus"))
    mapping = os.path.join(work, "map.json")
    json.dump({"code": PATH, "math": PATH, "prose": PATH}, open(mapping, "w"))
    shard(run, ShardOptions(dataset="lm", inputs=files, id_field="id", router="domain", domain_field="domain", domain_map=mapping, holdout=0.0))
    return run


def ours(run, cfg) -> tuple[float, dict]:
    from paths import checkpoint
    from paths.work.claims import claim
    from paths.work.train import train

    saved = {}
    real = checkpoint.save

    def timed_save(*a, **k):
        out = real(*a, **k)
        saved.update(out)
        return out

    checkpoint.save = timed_save
    try:
        lease = claim(run, [PATH], ttl=600, worker="bench")
        t = time.perf_counter()
        summary = train(run, PATH, "lm", "lm", cfg, lease, show_progress=False)
        return time.perf_counter() - t, {**summary, "checkpoint": saved}
    finally:
        checkpoint.save = real


def hf_trainer(run, cfg, work: str) -> float:
    """The same windows, model and schedule through transformers.Trainer."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from paths.models import materialize
    from sharding.dataset import PathDataset

    hf_logging.set_verbosity_error()
    folder = os.path.join(work, "hf-init")
    shutil.rmtree(folder, ignore_errors=True)
    materialize(run, PATH, folder)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    windows = PathDataset(run, "lm", PATH, cfg.seq_len, seed=cfg.seed, batch_size=cfg.batch_size, epochs=None)
    n = cfg.steps * cfg.batch_size * cfg.grad_accum
    rows = []
    for sample in windows:
        t = sample["tokens"]
        labels = t[:-1].clone()  # the model shifts them: position i learns token i + 1, as ours
        labels[int(sample["valid"]) :] = -100
        rows.append({"input_ids": t[:-1], "labels": labels})
        if len(rows) == n:
            break

    class Windows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    args = TrainingArguments(
        output_dir=os.path.join(work, "hf-out"), per_device_train_batch_size=cfg.batch_size, gradient_accumulation_steps=cfg.grad_accum,
        max_steps=cfg.steps, learning_rate=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.beta1, adam_beta2=cfg.beta2,
        adam_epsilon=cfg.eps, max_grad_norm=cfg.max_grad_norm, warmup_steps=cfg.warmup_steps, lr_scheduler_type="cosine",
        logging_steps=10, save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, seed=cfg.seed,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Windows())
    t = time.perf_counter()
    trainer.train()
    return time.perf_counter() - t


def one_run(args) -> dict:
    """One arm's run in this process, as a user runs it (`paths train`, or a script calling
    Trainer.train()); hf-malloc: HF Trainer after our allocator setting (paths/allocator.py)."""
    from paths.train_config import load_config
    from storage.layout import open_run

    run = open_run(os.path.join(args.work, "run"))
    cfg = load_config(sets=[f"seq_len={args.seq_len}", f"batch_size={args.batch}", "warmup_steps=3"], steps=args.steps, checkpoint_every=args.steps // 2)
    tokens = args.steps * args.batch * args.seq_len
    if args.arm != "ours":
        if args.arm == "hf-malloc":
            from paths.allocator import keep_freed_memory

            assert keep_freed_memory(), "glibc's mallopt refused the setting"
        return {"tok_s": tokens / hf_trainer(run, cfg, args.work)}
    import transformers.models.mistral.modeling_mistral  # noqa: F401  imported before the clock, as the HF arm's are
    from paths.work.train import train  # noqa: F401

    run.store.delete(run.claim(PATH))  # the path afresh: no claim, no work, no final
    run.store.delete_prefix(run.work(PATH))
    run.store.delete_prefix(run.final(PATH))
    seconds, summary = ours(run, cfg)
    loop = json.loads(run.store.read(f"work/{PATH}/metrics.jsonl").decode().splitlines()[-1])["tokens_per_s"]
    return {"tok_s": tokens / seconds, "loop_tok_s": loop, "checkpoint": summary["checkpoint"]}


def _claimer(url: str, options: dict, ids: list[str], barrier, results) -> None:
    from paths.work.claims import claim
    from paths.errors import NothingToClaim
    from storage.layout import open_run

    run = open_run(url, options)
    calls = [0]
    for name in ("read_with_etag", "put_if_absent", "put_if_match", "list_page"):  # the store's round trips a claim makes
        def counted(*a, _f=getattr(run.store, name), **k):
            calls[0] += 1
            return _f(*a, **k)
        setattr(run.store, name, counted)
    barrier.wait()
    times, trips = [], []
    while True:
        t, before = time.perf_counter(), calls[0]
        try:
            claim(run, ids, ttl=600)
        except NothingToClaim:
            break
        times.append(time.perf_counter() - t)
        trips.append(calls[0] - before)
    results.put((times, trips))


def claims_on_seaweed(work: str, claimers: int = 16, races: int = 5) -> dict:
    """`races` races of `claimers` processes over 256 fresh paths each, on one SeaweedFS: the p50
    and p99 of each race's claims, and their medians (one race's p99 is its 3rd-slowest claim)."""
    from paths.prepare.init import init_run
    from paths.prepare.decompose import decompose
    from storage.layout import open_run
    from storage.seaweed import start_seaweed

    folder = os.path.join(work, "seaweed")
    os.makedirs(folder, exist_ok=True)
    p50, p99, trips, claims = [], [], [], 0
    with start_seaweed(folder) as server:
        for race in range(races):
            url = f"s3://bench/claims-{race}"
            init_run(url, preset="tiny-mixtral", storage_options=server.storage_options)
            paths = decompose(open_run(url, server.storage_options), 4)["paths"]  # 4^4 = 256
            got = _race(url, server.storage_options, paths, claimers)
            times = sorted(t for ts, _ in got for t in ts)
            trips += [n for _, ns in got for n in ns]
            claims += len(times)
            p50.append(1000 * times[len(times) // 2])
            p99.append(1000 * times[min(len(times) - 1, int(0.99 * len(times)))])
    return {"claims": claims, "races": races, "paths": len(paths), "claim_p50_ms": statistics.median(p50), "claim_p99_ms": statistics.median(p99),
            "claim_p50_all": p50, "claim_p99_all": p99, "claim_round_trips_mean": sum(trips) / len(trips), "claim_round_trips_max": max(trips)}


def _race(url: str, options: dict, paths: list[str], claimers: int) -> list[tuple[list[float], list[int]]]:
    """`claimers` processes, let go at once, claim `paths` until none is left: each one's claim times and round trips."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(claimers), ctx.Queue()
    procs = [ctx.Process(target=_claimer, args=(url, options, paths, barrier, results)) for _ in range(claimers)]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return got


def claims_line(out: dict) -> str:
    return (f"claims on SeaweedFS, 16 claimers, {out['paths']} paths, medians of {out['races']} races: p50 {out['claim_p50_ms']:.1f} ms, p99 {out['claim_p99_ms']:.1f} ms "
            f"(each race's p50 {', '.join(f'{x:.0f}' for x in out['claim_p50_all'])}; p99 {', '.join(f'{x:.0f}' for x in out['claim_p99_all'])}); "
            f"round trips a claim {out['claim_round_trips_mean']:.2f} (max {out['claim_round_trips_max']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "train"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each (medians reported)")
    parser.add_argument("--claims-only", action="store_true", help="only part 3, the claims on SeaweedFS")
    parser.add_argument("--arm", choices=["ours", "hf", "hf-malloc"], help=argparse.SUPPRESS)  # one run in a process of its own (the bench starts them)
    args = parser.parse_args()
    if args.claims_only:
        os.makedirs(args.work, exist_ok=True)
        out = claims_on_seaweed(os.path.join(args.work, f"claims-{os.getpid()}"))
        print(claims_line(out))
        return
    if args.arm:  # one timed run in this fresh process, over the run `build` made; its figures as one JSON line
        print(json.dumps(one_run(args)))
        return
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    build(args.work, args.steps)
    tokens = args.steps * args.batch * args.seq_len
    runs: dict[str, list[dict]] = {"ours": [], "hf": [], "hf-malloc": []}
    for r in range(args.repeats):
        for arm in (("hf", "ours", "hf-malloc") if r % 2 == 0 else ("hf-malloc", "ours", "hf")):
            cmd = [sys.executable, os.path.abspath(__file__), "--arm", arm, "--work", args.work, "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--batch", str(args.batch)]
            with tempfile.TemporaryDirectory() as home:  # the run's own claim file
                out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PATHS_HOME": home})
            if out.returncode:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
            runs[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
    mine, hf, hf_malloc = ([x["tok_s"] for x in runs[a]] for a in ("ours", "hf", "hf-malloc"))
    loop = [x["loop_tok_s"] for x in runs["ours"]]
    summary = runs["ours"][-1]
    ck = summary["checkpoint"]
    result = {
        "steps": args.steps, "seq_len": args.seq_len, "batch": args.batch, "tokens": tokens, "cpus": os.cpu_count(), "repeats": args.repeats,
        "ours_tok_s": statistics.median(mine), "hf_trainer_tok_s": statistics.median(hf), "ratio": statistics.median(mine) / statistics.median(hf), "pair_ratios": [o / h for o, h in zip(mine, hf)],
        "ours_all": mine, "hf_all": hf, "checkpoint_s": ck.get("seconds"), "checkpoint_bytes": ck.get("bytes"), "ours_loop_tok_s": statistics.median(loop),
        "hf_malloc_tok_s": statistics.median(hf_malloc), "hf_malloc_all": hf_malloc, "ratio_same_allocator": statistics.median(mine) / statistics.median(hf_malloc),
    }
    result["loop_ratio"] = result["ours_loop_tok_s"] / result["hf_trainer_tok_s"]
    result |= claims_on_seaweed(args.work)
    print(f"model: small-mixtral path {PATH}; {args.steps} steps x {args.batch} x {args.seq_len} tokens = {tokens:,} tokens; {os.cpu_count()} CPUs; medians of {args.repeats} alternating runs")
    print(f"paths train (whole call: materialize, claim heartbeat, 1 checkpoint, final) {result['ours_tok_s']:>9,.0f} tok/s")
    print(f"HF Trainer.train() (no checkpoints)                                  {result['hf_trainer_tok_s']:>9,.0f} tok/s   ratio {result['ratio']:.2f} (goal >= 1.1)")
    print(f"paths train, the step loop alone (from metrics.jsonl)                {result['ours_loop_tok_s']:>9,.0f} tok/s   ratio {result['loop_ratio']:.2f}")
    print(f"HF Trainer.train() given our allocator setting (paths/allocator.py) {result['hf_malloc_tok_s']:>9,.0f} tok/s   ours / it {result['ratio_same_allocator']:.2f}")
    print("each pair's ratio: " + ", ".join(f"{x:.2f}" for x in result["pair_ratios"]))
    print(f"checkpoint: {result['checkpoint_s']:.3f} s, {result['checkpoint_bytes']:,} bytes")
    print(claims_line(result))
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "train.jsonl"), "a") as f:
        f.write(json.dumps({"at": time.time(), **result}) + "\n")


if __name__ == "__main__":
    main()
