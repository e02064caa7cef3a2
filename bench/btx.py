"""Branch-Train-MiX end to end from the trained seed, per domain.

    .venv/bin/python bench/btx.py [--preset mini-mixtral] [--steps 200] [--ft-steps 100] [--seed-steps 1000]

BTX (Sukhbaatar et al. 2024): a seed model is branched into one copy per domain, each trained on
its domain alone, then mixed into an MoE whose experts are the branches' MLPs and whose shared
weights are their average, and the MoE is fine-tuned on all data with every parameter. Here:

1. seed: bench/seed.py (a dense model of path size trained on the corpus, cached), upcycled into
   the preset's MoE with one expert per domain (code, prose, math) and a one-level plan;
2. branch + train: path p0<d> trained N steps on domain d (the domain router), by the claim loop;
3. mix: `compose --router centroid` and `compose --router domain-embed` (FlexOlmo), then
   `finetune-moe --train all` for M steps on data mixed from every domain;
4. baselines: the seed continued densely on all data for N steps (equal wall-clock: the three
   branches train in parallel), and for 3N + M steps (equal total steps of 8 x 128 tokens; an
   MoE step with 2 of 3 experts active costs more than a dense one, so this favours dense).

Held-out perplexity per domain (each document its own sequence, the same documents in every run:
held out by a hash of their id), and each domain's own branch on its own domain. Printed as a
table with ratios to both dense baselines; appended to bench/out/btx.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DOMAINS = {"code": "p00", "prose": "p01", "math": "p02"}


def per_domain(run, docs: dict[str, list], models: dict[str, str]) -> dict[str, dict[str, float]]:
    """{label: {domain: held-out perplexity, "overall": ...}}; `path:own` scores each domain with its own branch."""
    from bench.dipaco import document_nll
    from paths.models import load_model

    by_path = {p: d for d, p in DOMAINS.items()}
    out = {}
    with tempfile.TemporaryDirectory() as scratch:
        for label, spec in models.items():
            shared = None if spec == "path:own" else load_model(run, spec, scratch)[0]
            row, total, count = {}, 0.0, 0
            for shard, shard_docs in docs.items():
                model = shared if shared is not None else load_model(run, f"path:{shard}", scratch)[0]
                nll, n = document_nll(model, shard_docs)
                row[by_path[shard]] = math.exp(nll / max(1, n))
                total, count = total + nll, count + n
            row["overall"] = math.exp(total / max(1, count))
            out[label] = row
            print(f"  {label}: " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mini-mixtral")
    ap.add_argument("--steps", type=int, default=200, help="N: steps of each domain's branch")
    ap.add_argument("--ft-steps", type=int, default=100, help="M: steps of finetune-moe --train all")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ft-lr", type=float, default=5e-4)
    ap.add_argument("--seed-steps", type=int, default=1000)
    ap.add_argument("--seed-lr", type=float, default=2e-3)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "btx"))
    a = ap.parse_args()

    from bench.dipaco import cfg, dense, documents, heldout_documents, worker_loop
    from bench.seed import trained_seed
    from compose.finetune import finetune_moe
    from compose.merge import compose_moe
    from paths.prepare.decompose import decompose
    from paths.prepare.init import upcycle
    from sharding.shard import ShardOptions, shard
    from storage.layout import open_run

    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    t_start = time.perf_counter()
    seed_dir, seed = trained_seed(a.preset, a.seed_steps, a.seed_lr, a.max_len)
    files = documents(os.path.join(a.work, "corpus"))
    mapping = os.path.join(a.work, "domains.json")
    with open(mapping, "w") as f:
        json.dump(DOMAINS, f)

    # branch: one expert per domain, upcycled from the seed; train: each branch on its domain
    folder = os.path.join(a.work, "btx")
    upcycle(folder, seed_dir, experts=len(DOMAINS), top_k=2, seed=0)
    run = open_run(folder)
    decompose(run, 1)
    shard(run, ShardOptions(dataset="web", inputs=files, id_field="id", router="domain", domain_field="domain", domain_map=mapping, holdout=0.05))
    seconds = {"branches": worker_loop(run, "web", cfg(a.steps, a.lr))}
    print(f"{len(DOMAINS)} branches x {a.steps} steps: {seconds['branches']:.0f}s", flush=True)

    # mix
    t0 = time.perf_counter()
    compose_moe(run, "btx-centroid", router="centroid", router_data="web")
    compose_moe(run, "btx-embed", router="domain-embed", router_data="web")
    finetune_moe(run, "btx-centroid", "web", "btx-ft", cfg(a.ft_steps, a.ft_lr), train="all", show_progress=True)
    seconds["mix"] = time.perf_counter() - t0

    # the seed continued densely
    t0 = time.perf_counter()
    total = len(DOMAINS) * a.steps + a.ft_steps
    dense_wall = dense(os.path.join(a.work, "dense-n"), a.preset, files, a.steps, a.lr, seed_dir)
    dense_total = dense(os.path.join(a.work, "dense-total"), a.preset, files, total, a.lr, seed_dir)
    seconds["dense"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    docs = heldout_documents(run, "web", a.max_len)
    table = per_domain(run, docs, {
        "seed (the upcycled base)": "base",
        "each domain's own branch": "path:own",
        "BTX: composed, centroid router": "composed:btx-centroid",
        "BTX: composed, domain-embed router": "composed:btx-embed",
        f"BTX: centroid + finetune-moe --train all ({a.ft_steps})": "composed:btx-ft",
        f"dense N = {a.steps} (equal wall-clock)": f"hf:{dense_wall}",
        f"dense 3N + M = {total} (equal total steps)": f"hf:{dense_total}",
    })
    seconds["eval"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - t_start
    wall, eq = table[f"dense N = {a.steps} (equal wall-clock)"], table[f"dense 3N + M = {total} (equal total steps)"]
    cols = [*DOMAINS, "overall"]
    width = max(map(len, table))
    print(f"\nheld-out perplexity per domain ({a.preset}; seed {a.seed_steps} steps, perplexity {seed['heldout_perplexity']:.2f}; N = {a.steps}, M = {a.ft_steps}; lower is better)")
    print(f"  {'model':<{width}}  " + "  ".join(f"{c:>8}" for c in cols) + "   / dense N (overall)  / dense 3N+M (overall)")
    for name, row in table.items():
        print(f"  {name:<{width}}  " + "  ".join(f"{row[c]:8.2f}" for c in cols) + f"   {row['overall'] / wall['overall']:.3f}              {row['overall'] / eq['overall']:.3f}")
    ft = table[f"BTX: centroid + finetune-moe --train all ({a.ft_steps})"]
    print("  BTX + finetune <= dense at equal total steps, per domain: " + ", ".join(f"{d} {'yes' if ft[d] <= eq[d] else 'no'} ({ft[d] / eq[d]:.3f})" for d in DOMAINS))
    comp = table["BTX: composed, centroid router"]
    print("  composed (no fine-tuning) <= dense at equal wall-clock, per domain: " + ", ".join(f"{d} {'yes' if comp[d] <= wall[d] else 'no'} ({comp[d] / wall[d]:.3f})" for d in DOMAINS))
    print(f"seconds: {json.dumps({k: round(v) for k, v in seconds.items()})}")
    print(f"reproduce: .venv/bin/python bench/btx.py --preset {a.preset} --steps {a.steps} --ft-steps {a.ft_steps} --lr {a.lr} --ft-lr {a.ft_lr} --seed-steps {a.seed_steps} --seed-lr {a.seed_lr}")
    record = {"bench": "btx", "preset": a.preset, "steps": a.steps, "ft_steps": a.ft_steps, "lr": a.lr, "ft_lr": a.ft_lr,
              "seed": {k: seed[k] for k in ("steps", "lr", "heldout_perplexity", "sha256")}, "perplexity": table, "seconds": seconds, "at": time.time()}
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "btx.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
