"""The memory plan (`paths plan --config`'s table) against measured peak memory on the CPU.

    .venv/bin/python bench/memory_plan.py [--presets mini-mixtral,small-mixtral,bench-mixtral] [--micro-batch 4] [--seq-len 128]

For each preset, path p00 of a one-level plan trains 3 AdamW steps in each mode (full fp32, LoRA
rank 16 on attention and experts over an fp32 base, the same over an int8 base), each in a fresh
process. Measured: the peak resident memory during the steps (the kernel's high-water mark,
reset once the model is built) minus the process's memory before the model was loaded. Estimated:
`paths.prepare.decompose.memory_plan` with the path's exact parameter counts. Goal: within 20%.
Appended to bench/out/memory_plan.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHILD = r'''
import ctypes, json, sys, torch
from transformers import AutoModelForCausalLM
from paths.adapters import LoraSpec, attach, target_modules
from paths.trainer import make_optimizer
from paths.train_config import TrainConfig

def rss(field):
    return int([l for l in open("/proc/self/status") if l.startswith(field)][0].split()[1]) * 1024

folder, mode, experts, batch, seq = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(2)
torch.ones(1)
before = rss("VmRSS")
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
if mode != "full":
    spec = LoraSpec(rank=16, alpha=32, targets=("attention", "experts"), base="int8" if mode == "lora-int8" else "fp32")
    model = attach(model, spec, target_modules(model, spec, experts, False, "p00"))
model.train()
opt = make_optimizer(model, TrainConfig())
ctypes.CDLL("libc.so.6").malloc_trim(0)
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark from here
tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
for _ in range(3):
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
print(json.dumps({"measured": rss("VmHWM") - before}))
'''


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from paths.adapters import LoraSpec, attach, target_modules
    from paths.base import require_base
    from paths.families import get_family
    from paths.models import materialize
    from paths.prepare.decompose import decompose, memory_plan
    from paths.prepare.init import init_run
    from storage.layout import open_run

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="mini-mixtral,small-mixtral,bench-mixtral")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "memory_plan"))
    a = ap.parse_args()
    hf_logging.disable_progress_bar()
    rows = []
    print(f"{'preset':14} {'mode':22} {'estimated MiB':>14} {'measured MiB':>13} {'est / meas':>11}")
    for preset in a.presets.split(","):
        url = os.path.join(a.work, preset, "run")
        if not os.path.exists(os.path.join(url, "paths")):
            init_run(url, preset=preset, seed=0)
            decompose(open_run(url), 1)
        run = open_run(url)
        folder = os.path.join(a.work, preset, "p00")
        if not os.path.exists(folder):
            materialize(run, "p00", folder)
        family = get_family(require_base(run)["base"]["family"])
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        experts = [p for layer in family.sparse_layers(model.config) for p in family.path_expert_parameters(layer)]
        params = sum(p.numel() for p in model.parameters())
        linear = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n)
        probe = attach(model, LoraSpec(rank=1, alpha=1, targets=("attention", "experts")), target_modules(model, LoraSpec(rank=1, alpha=1, targets=("attention", "experts")), experts, False, "p00"))
        per_rank = sum(p.numel() for p in probe.parameters() if p.requires_grad)
        plan = memory_plan(params, model.config, model.config.intermediate_size, a.micro_batch, a.seq_len, 16, (per_rank, linear))
        del model, probe
        for mode, row in (("full", "fp32 AdamW"), ("lora", "LoRA r16"), ("lora-int8", "LoRA r16, int8 base")):
            proc = subprocess.run([sys.executable, "-c", CHILD, folder, mode, json.dumps(experts), str(a.micro_batch), str(a.seq_len)], cwd=ROOT, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(proc.stderr[-2000:])
            measured = json.loads(proc.stdout.strip().splitlines()[-1])["measured"] / 2**20
            estimated = plan[row]["total"] * 1024
            rows.append({"preset": preset, "mode": row, "params": params, "estimated_mib": estimated, "measured_mib": measured, "ratio": estimated / measured})
            print(f"{preset:14} {row:22} {estimated:>14.1f} {measured:>13.1f} {estimated / measured:>11.2f}")
    with open(os.path.join(ROOT, "bench", "out", "memory_plan.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps({**r, "micro_batch": a.micro_batch, "seq_len": a.seq_len, "at": time.time()}) + "\n")
    print(f"\nreproduce: .venv/bin/python bench/memory_plan.py --presets {a.presets} --micro-batch {a.micro_batch} --seq-len {a.seq_len}")


if __name__ == "__main__":
    main()
