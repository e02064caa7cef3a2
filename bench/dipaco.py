"""The DiPaCo experiment in miniature, from a trained seed: do paths pay off against the seed
continued densely?

    .venv/bin/python bench/dipaco.py [--preset mini-mixtral] [--steps 100] [--rounds 4] [--seed-steps 1000] [--report]

A multi-domain corpus found on the machine (the standard library's sources cut at top-level
`def` / `class`, Python's pydoc topics cut into paragraphs, generated arithmetic). The seed
(bench/seed.py: a dense model of path size trained `--seed-steps` on the corpus, cached) is
upcycled into the preset's MoE (every expert a copy of its MLP), cut in a two-level plan (4 x 4 =
16 paths of one expert per layer plus the shared weights), the documents routed by DiPaCo's
product k-means on the base's hidden states of each document's prefix, and every path trained
`--steps` steps by the claim loop (`claim` + `train`, as workers run it). Then the held-out
perplexity (the same documents for every model: held out by a hash of their id) of:

- the seed (= the upcycled base: its experts are copies);
- DiPaCo: each document routed by its prefix to one path: the router-mode ensemble
  (`compose --into ensemble --mix router`), and the same routing read from the shards (each
  path on its own shard's held-out documents, the "oracle" of the k-means router itself);
- dense N: the seed continued N steps on all data (equal compute per path, equal wall-clock
  when the 16 paths train in parallel);
- dense 16N: the seed continued 16 x N steps (equal total compute);
- the composed MoE with the seed's routers, and with a centroid router before and after
  `finetune-moe` (routers only, N steps);
- DiLoCo in place (`paths diloco --rounds R --inner-steps N/R`; each path keeps its AdamW state
  across rounds; outer lr 1 and no momentum by default, plain averaging each round: DiPaCo's
  Nesterov 0.7 / 0.9 is tuned for hundreds of rounds and overshoots in 4, `--outer-lr 0.7
  --momentum 0.9` measures it): composed/round-R and the router-mode ensemble of its paths,
  against one round of N steps (plain averaging).

Ratios are printed against both dense baselines whichever way they come out (DiPaCo's headline,
256 x 150M paths on C4: 12.39 vs 16.09 for dense 150M, ratio 0.77). Appended to
bench/out/dipaco.jsonl; `--report` writes `paths report` of the main run beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SEQ, BATCH, LEVELS, EXPERTS = 128, 8, 2, 4


def documents(folder: str) -> list[str]:
    """code / prose / math JSONL with many documents each (files cut at top-level definitions,
    topics at blank lines), so 16 clusters have something to split."""
    from sharding.corpus import code_docs, math_docs, prose_docs

    os.makedirs(folder, exist_ok=True)
    out = {"code": [], "prose": [], "math": math_docs(3000)}
    for doc in code_docs(400):
        parts = re.split(r"\n(?=(?:def|class|async def) )", doc["text"])
        out["code"] += [{"id": f"{doc['id']}#{i}", "domain": "code", "text": p} for i, p in enumerate(parts) if len(p) > 200]
    for doc in prose_docs():
        parts = re.split(r"\n\s*\n", doc["text"])
        out["prose"] += [{"id": f"{doc['id']}#{i}", "domain": "prose", "text": p} for i, p in enumerate(parts) if len(p) > 200]
    files = []
    for domain, docs in out.items():
        path = os.path.join(folder, f"{domain}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps(d) + "\n")
        files.append(path)
    return files


def cfg(steps: int, lr: float):
    from paths.train_config import load_config

    return load_config(sets=[f"seq_len={SEQ}", f"batch_size={BATCH}", "warmup_steps=10", f"lr={lr}"], steps=steps, checkpoint_every=0)


def worker_loop(run, dataset: str, config) -> float:
    """`while paths claim --wait 600; do paths train; done` in this process; the seconds it took."""
    from paths.errors import NothingToClaim
    from paths.units import claimable
    from paths.work.claims import claim, keep_alive
    from compose.diloco import train  # paths.work.train's, with a DiLoCo run's outer step

    t0 = time.perf_counter()
    while True:
        try:
            lease = claim(run, claimable(run), ttl=600, worker="bench", wait=600)
        except NothingToClaim:
            return time.perf_counter() - t0
        beat = keep_alive(lease)
        try:
            train(run, lease.path, "lm", dataset, config, lease, show_progress=False, heartbeat=beat)
        finally:
            beat.stop()


def new_run(folder: str, preset: str, files: list[str], router: str, dataset: str = "web", seed_dir: str | None = None, **shard_options):
    """A run of the preset's MoE: upcycled from the trained seed (every expert a copy of its MLP),
    or (no seed: training the seed itself) the preset's random init; the same base in every run."""
    from paths.prepare.decompose import decompose
    from paths.prepare.init import init_run, upcycle
    from sharding.shard import ShardOptions, shard
    from storage.layout import open_run

    if seed_dir:
        upcycle(folder, seed_dir, experts=EXPERTS, top_k=2, seed=0)
    else:
        init_run(folder, preset=preset, seed=0)
    run = open_run(folder)
    decompose(run, LEVELS)
    shard(run, ShardOptions(dataset=dataset, inputs=files, id_field="id", router=router, holdout=0.05, **shard_options))
    return run


def dense(folder: str, preset: str, files: list[str], steps: int, lr: float, seed_dir: str | None = None) -> str:
    """A path-size dense model trained `steps` on all the data: path p00-00 of the same base (the
    seed itself, when upcycled from it) with every document routed to it (the held-out documents
    are the same ones: a hash of their id)."""
    from paths.models import fetch_final

    mapping = os.path.join(folder + "-map.json")
    with open(mapping, "w") as f:
        json.dump({"code": "p00-00", "prose": "p00-00", "math": "p00-00"}, f)
    run = new_run(folder, preset, files, "domain", seed_dir=seed_dir, domain_field="domain", domain_map=mapping)
    from paths.work.claims import claim, keep_alive
    from compose.diloco import train  # paths.work.train's, with a DiLoCo run's outer step

    lease = claim(run, ["p00-00"], ttl=600, worker="bench")
    beat = keep_alive(lease)
    try:
        t0 = time.perf_counter()
        train(run, "p00-00", "lm", "web", cfg(steps, lr), lease, show_progress=True, heartbeat=beat)
        print(f"dense {steps} steps: {time.perf_counter() - t0:.0f}s", flush=True)
    finally:
        beat.stop()
    out = os.path.join(folder, "dense-final")
    fetch_final(run, "p00-00", out)
    return out


def heldout_documents(run, dataset: str, max_len: int) -> dict[str, list]:
    """{shard: its held-out documents' tokens (the first max_len of each)}, counted aloud."""
    from sharding.dataset import dataset_manifest, read_documents

    manifest = dataset_manifest(run, dataset)
    docs = {p: [d[:max_len] for d in read_documents(run, dataset, p, "heldout") if len(d) > 1] for p, e in sorted(manifest["paths"].items()) if e["heldout_docs"]}
    print(f"held-out: {sum(map(len, docs.values()))} documents, first {max_len} tokens of each", flush=True)
    return docs


@torch.inference_mode()
def document_nll(model, docs: list) -> tuple[float, int]:
    """Summed next-token NLL of each document as its own sequence, and the tokens predicted."""
    nll, n = 0.0, 0
    for d in docs:
        ids = torch.as_tensor(d.astype("int64")).unsqueeze(0)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        n += ids.shape[1] - 1
    return nll, n


def perplexities(run, docs: dict[str, list], models: dict[str, str]) -> dict[str, float]:
    """{label: held-out perplexity over every document} of each model spec of `run`
    (`path:*` reads each shard's documents with that shard's own path: the shard router's routing)."""
    import tempfile

    from paths.models import load_model

    out = {}
    with tempfile.TemporaryDirectory() as scratch:
        for label, spec in models.items():
            nll, n = 0.0, 0
            shared = None if spec == "path:*" else load_model(run, spec, scratch)[0]
            for shard, shard_docs in docs.items():
                model = shared if shared is not None else load_model(run, f"path:{shard}", scratch)[0]
                a, b = document_nll(model, shard_docs)
                nll, n = nll + a, n + b
            out[label] = math.exp(nll / max(1, n))
            print(f"  {label}: {out[label]:.3f}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mini-mixtral")
    ap.add_argument("--steps", type=int, default=100, help="N: steps per path")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rounds", type=int, default=4, help="R: DiLoCo rounds of N/R inner steps")
    ap.add_argument("--outer-lr", type=float, default=1.0, help="outer lr of the rounds (1.0 with momentum 0: plain averaging each round; DiPaCo: 0.7 with 0.9)")
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--seed-steps", type=int, default=1000, help="steps of the dense seed (bench/seed.py, cached)")
    ap.add_argument("--seed-lr", type=float, default=2e-3)
    ap.add_argument("--max-len", type=int, default=256, help="tokens of each held-out document scored")
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "dipaco"))
    ap.add_argument("--report", action="store_true", help="write `paths report` of the main run to WORK/report")
    args = ap.parse_args()
    if args.steps < args.rounds or args.steps % args.rounds:
        ap.error("--steps must be a multiple of --rounds (R rounds of N/R inner steps)")

    from bench.seed import trained_seed
    from compose.ensemble import compose_ensemble
    from compose.finetune import finetune_moe
    from compose.merge import compose_moe
    from paths.work.diloco import configure
    from sharding.dataset import dataset_manifest

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    t_start = time.perf_counter()
    seed_dir, seed = trained_seed(args.preset, args.seed_steps, args.seed_lr, args.max_len)
    files = documents(os.path.join(args.work, "corpus"))
    n, R = args.steps, args.rounds
    kmeans = dict(prefix_tokens=32, fit_sample=4096)

    # DiPaCo: 16 paths branched from the upcycled seed, product k-means routing, the claim loop
    run = new_run(os.path.join(args.work, "paths"), args.preset, files, "kmeans", seed_dir=seed_dir, **kmeans)
    manifest = dataset_manifest(run, "web")
    docs = {p: e["train_docs"] for p, e in sorted(manifest["paths"].items())}
    print(f"k-means routing, train documents per path: {docs}", flush=True)
    seconds = {"paths": worker_loop(run, "web", cfg(n, args.lr))}
    print(f"16 paths x {n} steps: {seconds['paths']:.0f}s", flush=True)
    compose_ensemble(run, "dipaco", mix="router", router_name="web")
    compose_moe(run, "moe", router="keep")
    compose_moe(run, "moe-centroid", router="centroid", router_data="web")
    t0 = time.perf_counter()
    finetune_moe(run, "moe-centroid", "web", "moe-centroid-ft", cfg(n, 1e-2), train="router", show_progress=True)
    seconds["finetune"] = time.perf_counter() - t0

    # the seed continued densely
    t0 = time.perf_counter()
    dense_n = dense(os.path.join(args.work, "dense-n"), args.preset, files, n, args.lr, seed_dir)
    dense_16n = dense(os.path.join(args.work, "dense-16n"), args.preset, files, 16 * n, args.lr, seed_dir)
    seconds["dense"] = time.perf_counter() - t0

    # DiLoCo in place: R rounds of N/R inner steps, each path's AdamW kept across rounds
    diloco = new_run(os.path.join(args.work, "diloco"), args.preset, files, "kmeans", seed_dir=seed_dir, **kmeans)
    same_docs = dataset_manifest(diloco, "web")["paths"] == manifest["paths"]
    configure(diloco, R, n // R, args.outer_lr, args.momentum)
    t0 = time.perf_counter()
    worker_loop(diloco, "web", cfg(n, args.lr))
    compose_ensemble(diloco, "dipaco-rounds", mix="router", router_name="web")
    seconds["diloco"] = time.perf_counter() - t0

    # held-out perplexity of each document as its own sequence, the same documents for every model
    t0 = time.perf_counter()
    heldout = heldout_documents(run, "web", args.max_len)
    ppl = perplexities(run, heldout, {
        "seed (dense, trained; the upcycled base)": "base",
        "dipaco (router-mode ensemble)": "composed:dipaco",
        "dipaco (each path on its shard)": "path:*",
        "dense N (the seed continued)": f"hf:{dense_n}",
        "dense 16N (the seed continued)": f"hf:{dense_16n}",
        "composed MoE, router keep": "composed:moe",
        "composed MoE, centroid router": "composed:moe-centroid",
        "composed MoE, centroid + finetune-moe": "composed:moe-centroid-ft",
    })
    rounds_label = f"{R} DiLoCo rounds of N/{R}"
    ppl.update(perplexities(diloco, heldout, {f"{rounds_label}: router-mode ensemble": "composed:dipaco-rounds", f"{rounds_label}: composed MoE": f"composed:round-{R}"}))
    dn, d16 = ppl["dense N (the seed continued)"], ppl["dense 16N (the seed continued)"]
    run.store.write(f"eval/web/{int(time.time())}.json", json.dumps({  # the table of the run's report
        "dataset": "web", "split": "heldout", "metric": f"perplexity (each document its own sequence, first {args.max_len} tokens)", "shards": ["overall"],
        "table": {k: {"overall": v, "/ dense N": v / dn, "/ dense 16N": v / d16} for k, v in ppl.items()}, "at": time.time()}).encode())
    seconds["eval"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - t_start

    print(f"\nheld-out perplexity ({args.preset}, 16 paths, N = {n} steps of {BATCH} x {SEQ} tokens, from the seed of {args.seed_steps} steps; "
          f"same held-out documents in every run: {same_docs})")
    width = max(map(len, ppl))
    for name, value in ppl.items():
        print(f"  {name:<{width}}  {value:9.3f}   / dense N {value / dn:.3f}   / dense 16N {value / d16:.3f}")
    print(f"  one round of N (router-mode ensemble) vs {rounds_label}: {ppl['dipaco (router-mode ensemble)']:.3f} vs {ppl[f'{rounds_label}: router-mode ensemble']:.3f}")
    print(f"  one round of N (composed MoE, plain average) vs {rounds_label} (composed MoE): {ppl['composed MoE, router keep']:.3f} vs {ppl[f'{rounds_label}: composed MoE']:.3f}")
    print(f"seconds: {json.dumps({k: round(v) for k, v in seconds.items()})}")
    print(f"reproduce: .venv/bin/python bench/dipaco.py --preset {args.preset} --steps {n} --lr {args.lr} --rounds {R} --outer-lr {args.outer_lr} --momentum {args.momentum} "
          f"--seed-steps {args.seed_steps} --seed-lr {args.seed_lr} --max-len {args.max_len}")

    record = {"bench": "dipaco", "preset": args.preset, "steps": n, "lr": args.lr, "rounds": R, "outer_lr": args.outer_lr, "momentum": args.momentum, "paths": 16,
              "seed": {k: seed[k] for k in ("steps", "lr", "heldout_perplexity", "sha256")}, "train_docs": docs, "same_heldout": same_docs, "perplexity": ppl,
              "ratio_vs_dense_n": {k: v / dn for k, v in ppl.items()}, "ratio_vs_dense_16n": {k: v / d16 for k, v in ppl.items()}, "seconds": seconds, "at": time.time()}
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "dipaco.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    if args.report:
        from compose.report import write_report

        print(f"report: {write_report(run, os.path.join(args.work, 'report'), overwrite=True).index}")


if __name__ == "__main__":
    main()
