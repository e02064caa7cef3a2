"""Bytes, publish and load time per policy version: deltas and adapters against full fp32 versions.

    .venv/bin/python bench/policy_versions.py [--presets mini-mixtral,bench-mixtral] [--versions 6]

For each preset (mini-mixtral is the quickstart's RL and swarm model; bench-mixtral a ~100M-parameter
path): path p00 of a one-level plan trains `--versions` AdamW steps on random tokens (every entry
moves, as in real training), and after each step the same weights are published three ways:
- full: every tensor in fp32 (what every version was before; `policy_snapshot_every = 0`);
- delta: int8 row-scaled deltas, zstd, between snapshots 16 versions apart (the default);
- adapter: a LoRA unit (rank 16 on attention and experts) trained the same way beside it.
A worker follows each stream (PolicyReader, rebuilding and checking every version). Printed: median
bytes, publish and load seconds per version after the first, each as a ratio to full (goals:
adapter <= 2%, delta <= 25% of full's bytes). Appended to bench/out/policy_versions.jsonl.
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


def measure(work: str, preset: str, versions: int, rank: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from paths.adapters import LoraSpec, attach, target_modules
    from paths.base import require_base
    from paths.families import get_family
    from paths.models import materialize
    from paths.prepare.decompose import decompose
    from paths.prepare.init import init_run
    from paths.work.rollouts.policy import PolicyReader, VersionWriter
    from storage.layout import open_run

    hf_logging.disable_progress_bar()
    url = os.path.join(work, preset, "run")
    init_run(url, preset=preset, seed=0)
    run = open_run(url)
    decompose(run, 1)
    folder = os.path.join(work, preset, "p00")
    materialize(run, "p00", folder)

    def fresh():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    full_model, lora_model = fresh(), fresh()
    family = get_family(require_base(run)["base"]["family"])
    experts = [p for layer in family.sparse_layers(lora_model.config) for p in family.path_expert_parameters(layer)]
    spec = LoraSpec(rank=rank, alpha=2 * rank, targets=("attention", "experts"))
    lora_model = attach(lora_model, spec, target_modules(lora_model, spec, experts, False, "p00"))
    streams = {
        "full": (full_model, VersionWriter(run, "full", "00" * 32, 0)),
        "delta": (full_model, VersionWriter(run, "delta", "00" * 32, 16)),
        "adapter": (lora_model, VersionWriter(run, "adapter", "00" * 32, 16, spec, fresh)),
    }
    readers = {name: PolicyReader(run, name, fresh()) for name in streams}
    optimizers = {id(m): torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4) for m in (full_model, lora_model)}
    vocab = full_model.config.vocab_size
    out: dict[str, dict[str, list[float]]] = {name: {"bytes": [], "publish_s": [], "load_s": []} for name in streams}
    for v in range(versions + 1):
        if v:
            for model in (full_model, lora_model):
                tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(v))
                model(input_ids=tokens, labels=tokens).loss.backward()
                optimizers[id(model)].step()
                optimizers[id(model)].zero_grad()
        for name, (model, writer) in streams.items():
            t0 = time.perf_counter()
            record = writer.publish(v, model)
            t1 = time.perf_counter()
            readers[name].load(v)
            t2 = time.perf_counter()
            if v:  # the first is a full snapshot in every stream (the adapter's base is written then)
                out[name]["bytes"].append(record["bytes"])
                out[name]["publish_s"].append(t1 - t0)
                out[name]["load_s"].append(t2 - t1)
    params = sum(p.numel() for p in full_model.parameters())
    med = {name: {k: statistics.median(vals) for k, vals in m.items()} for name, m in out.items()}
    return {"preset": preset, "path_params": params, "versions": versions, "lora_rank": rank, "lora_targets": list(spec.targets), **med}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="mini-mixtral,bench-mixtral")
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "policy_versions"))
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    rows = []
    for preset in a.presets.split(","):
        r = measure(a.work, preset, a.versions, a.rank)
        rows.append(r)
        full = r["full"]
        print(f"\n{preset}: path of {r['path_params'] / 1e6:.2f}M parameters, {a.versions} versions after the first (medians)")
        print(f"{'kind':8} {'bytes':>12} {'/ full':>8} {'publish s':>10} {'/ full':>8} {'load s':>8} {'/ full':>8}")
        for kind in ("full", "delta", "adapter"):
            m = r[kind]
            print(f"{kind:8} {m['bytes']:>12,.0f} {m['bytes'] / full['bytes']:>8.3f} {m['publish_s']:>10.3f} {m['publish_s'] / full['publish_s']:>8.2f} {m['load_s']:>8.3f} {m['load_s'] / full['load_s']:>8.2f}")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "policy_versions.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps({**r, "at": time.time()}) + "\n")
    print("\nreproduce: .venv/bin/python bench/policy_versions.py --presets " + a.presets)


if __name__ == "__main__":
    main()
