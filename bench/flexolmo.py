"""A miniature FlexOlmo: anchored vs free expert training at equal compute, then composition.

    .venv/bin/python bench/flexolmo.py [--preset small-mixtral] [--public-steps 150] [--steps 100]

1. Public model: a one-level run of the preset; path p00 is trained (free) on the public half of a
   local corpus (every other document of code, prose, math), then upcycled (every expert a copy of
   its MLP) into the experiment's base, as FlexOlmo starts each expert from the public one.
2. Three data owners (code -> p00, prose -> p01, math -> p02) train their expert on their private
   half, in two arms with the same steps, batch and learning rate:
   - anchored: `--freeze shared` (attention, embeddings, norms, head stay the public model's);
   - free: everything trains (shared tensors are averaged at compose time).
3. Each arm is composed with `--router domain-embed`, and again with the math owner opted out.
4. Held-out perplexity per domain: the public base, each expert alone, the composed MoE and the
   opted-out one. Printed as tables; appended to bench/out/flexolmo.jsonl.
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

OWNERS = {"code": "p00", "prose": "p01", "math": "p02"}
OUT = "math"


def split_corpus(folder: str) -> tuple[str, str]:
    """public.jsonl (even documents of each domain, no domain field needed) and private.jsonl."""
    from sharding.corpus import write_corpus

    files = write_corpus(os.path.join(folder, "corpus"))
    public, private = os.path.join(folder, "public.jsonl"), os.path.join(folder, "private.jsonl")
    with open(public, "w") as pub, open(private, "w") as priv:
        for path in files:
            for i, line in enumerate(open(path)):
                (pub if i % 2 == 0 else priv).write(line)
    return public, private


def train_paths(run, dataset: str, paths: list[str], steps: int, freeze: str, lr: float) -> dict[str, dict]:
    from paths.work.train import train
    from paths.train_config import load_config

    cfg = load_config(sets=["seq_len=256", "batch_size=8", "warmup_steps=10", f"lr={lr}", f"freeze={freeze}"], steps=steps, checkpoint_every=0)
    out = {}
    for pid in paths:
        t0 = time.perf_counter()
        summary = train(run, pid, "lm", dataset, cfg, None, show_progress=True)
        out[pid] = {"loss": summary["final_loss"], "tokens": summary["tokens"], "seconds": round(time.perf_counter() - t0, 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-mixtral")
    ap.add_argument("--public-steps", type=int, default=150)
    ap.add_argument("--steps", type=int, default=100, help="steps per owner's expert, in each arm")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "flexolmo"))
    args = ap.parse_args()

    from cli.render import render_eval
    from compose.evaluate import evaluate
    from compose.merge import compose_moe
    from paths.prepare.init import init_run, upcycle
    from paths.prepare.decompose import decompose
    from paths.models import fetch_final
    from sharding.shard import ShardOptions, shard
    from storage.layout import open_run

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    t_start = time.perf_counter()
    public, private = split_corpus(args.work)

    # 1. the public model, upcycled into the experiment's base
    init_run(os.path.join(args.work, "public"), preset=args.preset, seed=0)
    pub = open_run(os.path.join(args.work, "public"))
    decompose(pub, 1)
    shard(pub, ShardOptions(dataset="public", inputs=[public], id_field="id", router="hash", holdout=0.0))
    public_train = train_paths(pub, "public", ["p00"], args.public_steps, "none", args.lr)
    dense = os.path.join(args.work, "public-dense")
    fetch_final(pub, "p00", dense)
    experts = json.load(open(os.path.join(pub.store.path("base"), "config.json")))["num_local_experts"]
    base_url = os.path.join(args.work, "anchored")
    upcycle(base_url, dense, experts=experts, top_k=2, seed=0)
    anchored = open_run(base_url)
    decompose(anchored, 1)
    domain_map = os.path.join(args.work, "owners.json")
    json.dump(OWNERS, open(domain_map, "w"))
    shard(anchored, ShardOptions(dataset="private", inputs=[private], id_field="id", router="domain", domain_field="domain", domain_map=domain_map, holdout=0.1))
    shutil.copytree(anchored.store.root, os.path.join(args.work, "free"))
    free = open_run(os.path.join(args.work, "free"))

    # 2-4. two arms at equal compute, composed, evaluated
    results = {}
    models = ["base", *(f"path:{p}" for p in OWNERS.values()), "composed:moe", f"composed:moe-no-{OUT}"]
    names = {p: f"{d}:{p}" for d, p in OWNERS.items()}
    for arm, run, freeze in (("anchored", anchored, "shared"), ("free", free, "none")):
        trained = train_paths(run, "private", list(OWNERS.values()), args.steps, freeze, args.lr)
        record = compose_moe(run, "moe", router="domain-embed", router_data="private", router_docs=32)
        compose_moe(run, f"moe-no-{OUT}", router="domain-embed", router_data="private", router_docs=32, exclude=[OWNERS[OUT]])
        result = evaluate(run, "private", models, split="heldout", max_tokens=40_000)
        result["shards"] = [names[s] for s in result["shards"] if s in names]
        result["table"] = {m: {names.get(k, k): v for k, v in row.items()} for m, row in result["table"].items()}
        print(f"\n== {arm} ({'--freeze shared' if freeze == 'shared' else 'everything trains'}): {args.steps} steps per expert; shared tensors: {record['shared']}")
        print(render_eval(result))
        results[arm] = {"train": trained, "table": result["table"]}

    print("\n== summary: held-out perplexity ratios (lower is better)")
    rows = []
    for arm, r in results.items():
        t = r["table"]
        for domain, pid in OWNERS.items():
            col = f"{domain}:{pid}"
            best_single = min(t[f"path:{p}"][col] for p in OWNERS.values())
            rows.append((arm, domain, t["composed:moe"][col] / t["base"][col], t["composed:moe"][col] / best_single,
                         t[f"composed:moe-no-{OUT}"][col] / t["composed:moe"][col]))
    print(f"{'arm':9} {'domain':7} {'MoE/base':>9} {'MoE/own expert':>15} {'opt-out/MoE':>12}")
    for arm, domain, a, b, c in rows:
        print(f"{arm:9} {domain:7} {a:9.3f} {b:15.3f} {c:12.3f}")
    seconds = round(time.perf_counter() - t_start, 1)
    print(f"\n(public model: {args.public_steps} steps, loss {public_train['p00']['loss']:.3f}; {seconds}s in all)")
    print(f"reproduce: .venv/bin/python bench/flexolmo.py --preset {args.preset} --public-steps {args.public_steps} --steps {args.steps} --lr {args.lr}")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "flexolmo.jsonl"), "a") as f:
        f.write(json.dumps({"at": time.time(), "args": vars(args), "public": public_train, "results": results, "seconds": seconds}) + "\n")


if __name__ == "__main__":
    main()
