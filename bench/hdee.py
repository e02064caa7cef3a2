"""A miniature HDEE: heterogeneous domain experts against homogeneous ones at equal total compute.

    .venv/bin/python bench/hdee.py [--preset small-mixtral] [--steps 100]

Three local domains (code: stdlib sources, prose: pydoc topics, math: generated arithmetic), one
expert per domain in each of three arms; an arm's compute is sum over its experts of
6 x parameters x tokens, the same for every arm:
- homogeneous:  every expert `small`, `--steps` steps each;
- sizes:        code `small-xl`, prose `small`, math `small-half` (harder domains get bigger
                models), every expert the same number of steps, set so the arm's compute matches;
- steps:        every expert `small`; code 1.5x, prose 1x, math 0.5x `--steps` (harder domains
                train longer).
Every expert sees batches of 8 x 256 tokens at the same learning rate. Each arm is ensembled with
`paths compose --into ensemble --mix posterior --prior cached`. Printed: held-out perplexity per
domain of each ensemble and of each arm's own-domain expert (oracle routing), and the arms'
compute. Appended to bench/out/hdee.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DOMAINS = ("code", "prose", "math")
SIZES = {"code": "small-xl", "prose": "small", "math": "small-half"}
STEP_SHARE = {"code": 1.5, "prose": 1.0, "math": 0.5}
SEQ, BATCH = 256, 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-mixtral", help="the run's base (its tokenizer and family)")
    ap.add_argument("--steps", type=int, default=100, help="steps per expert in the homogeneous arm")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "hdee"))
    args = ap.parse_args()

    from cli.render import render_eval
    from compose.ensemble import compose_ensemble
    from compose.evaluate import evaluate
    from experts.domain import add_expert
    from paths.prepare.init import init_run
    from paths.work.train import train
    from paths.train_config import load_config
    from sharding.corpus import write_corpus
    from sharding.shard import ShardOptions, shard
    from storage.layout import open_run

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    t_start = time.perf_counter()
    files = write_corpus(os.path.join(args.work, "corpus"))
    init_run(os.path.join(args.work, "run"), preset=args.preset, seed=0)
    run = open_run(os.path.join(args.work, "run"))

    tokens_per_step = SEQ * BATCH
    params = {}
    for d in DOMAINS:  # sizes first: the sizes arm's steps follow from the parameter counts
        for arm, preset in (("homogeneous", "small"), ("sizes", SIZES[d]), ("steps", "small")):
            params[f"{arm}-{d}"] = add_expert(run, f"{arm}-{d}", d, preset=preset, seed=0)["parameters"]
    budget = sum(6 * params[f"homogeneous-{d}"] * tokens_per_step * args.steps for d in DOMAINS)
    size_steps = round(budget / sum(6 * params[f"sizes-{d}"] * tokens_per_step for d in DOMAINS))
    steps = {f"homogeneous-{d}": args.steps for d in DOMAINS}
    steps.update({f"sizes-{d}": size_steps for d in DOMAINS})
    steps.update({f"steps-{d}": round(args.steps * STEP_SHARE[d]) for d in DOMAINS})
    shard(run, ShardOptions(dataset="domains", inputs=files, id_field="id", router="domain", targets="domains", domain_field="domain", holdout=0.1))

    trained = {}
    for name, n in steps.items():
        cfg = load_config(sets=[f"seq_len={SEQ}", f"batch_size={BATCH}", "warmup_steps=10", f"lr={args.lr}"], steps=n, checkpoint_every=0)
        t0 = time.perf_counter()
        out = train(run, name, "lm", "domains", cfg, None, show_progress=True)
        trained[name] = {"steps": n, "parameters": params[name], "loss": out["final_loss"], "seconds": round(time.perf_counter() - t0, 1)}
    compute = {arm: sum(6 * params[f"{arm}-{d}"] * tokens_per_step * steps[f"{arm}-{d}"] for d in DOMAINS) for arm in ("homogeneous", "sizes", "steps")}

    models = []
    for arm in ("homogeneous", "sizes", "steps"):
        compose_ensemble(run, arm, members=[f"{arm}-{d}" for d in DOMAINS], mix="posterior", prior="cached", prior_data="domains", prior_docs=100)
        models.append(f"composed:{arm}")
    models += [f"expert:{arm}-{d}" for arm in ("homogeneous", "sizes", "steps") for d in DOMAINS]
    result = evaluate(run, "domains", models, split="heldout", max_tokens=40_000)
    print()
    print(render_eval(result))

    table = result["table"]
    print("\n== per domain, held-out perplexity (lower is better)")
    print(f"{'arm':12} {'compute (PF)':>12}  " + "  ".join(f"{'ens ' + d:>11} {'own ' + d:>11}" for d in DOMAINS) + f"  {'ens overall':>11}")
    for arm in ("homogeneous", "sizes", "steps"):
        cells = "  ".join(f"{table[f'composed:{arm}'][d]:11.2f} {table[f'expert:{arm}-{d}'][d]:11.2f}" for d in DOMAINS)
        print(f"{arm:12} {compute[arm] / 1e15:12.3f}  {cells}  {table[f'composed:{arm}']['overall']:11.2f}")
    print("\nexperts: " + "; ".join(f"{n} {t['parameters'] / 1e6:.2f}M x {t['steps']} steps" for n, t in trained.items()))
    seconds = round(time.perf_counter() - t_start, 1)
    print(f"({seconds}s in all)\nreproduce: .venv/bin/python bench/hdee.py --preset {args.preset} --steps {args.steps} --lr {args.lr}")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "hdee.jsonl"), "a") as f:
        f.write(json.dumps({"at": time.time(), "args": vars(args), "experts": trained, "compute": compute, "table": table, "seconds": seconds}) + "\n")


if __name__ == "__main__":
    main()
