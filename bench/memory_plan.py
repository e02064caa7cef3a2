"""The memory plan (`paths plan --config`'s table) against measured peak memory on the CPU.

    .venv/bin/python bench/memory_plan.py [--presets mini-mixtral,small-mixtral,bench-mixtral] [--micro-batch 4] [--seq-len 128]

For each preset, path p00 of a one-level plan trains 3 AdamW steps in each mode (full fp32, full
fp32 sharded over 2 gloo ranks with FSDP2 (rank 0 measured), LoRA rank 16 on attention and experts
over an fp32 base, the same over an int8 base), each in fresh processes. Measured: the peak resident memory during the steps (the kernel's high-water mark,
reset once the model is built) minus the process's memory before the model was loaded, minus the
runtime's own (the same steps on a model with next to no tensors: thread pools, kernels' buffers;
a CUDA context on a GPU), which the plan leaves out. Estimated:
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
sharded = mode.endswith("fsdp")  # one of 2 gloo ranks (rank 0 reports)
if sharded:
    torch.distributed.init_process_group("gloo")
torch.set_num_threads(1 if sharded else 2)
torch.ones(1)
before = rss("VmRSS")
if mode.startswith("runtime"):  # the framework's own cost: a model with next to no tensors, the same steps
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1))
    batch, seq = 1, 8
else:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
if sharded:
    from paths.fsdp import shard
    model = shard(model)
if mode.startswith("lora"):
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
if sharded:
    torch.distributed.destroy_process_group()
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
    ap.add_argument("--presets", default="small-mixtral,bench-mixtral,dipaco-16x16-150m")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "memory_plan"))
    a = ap.parse_args()
    hf_logging.disable_progress_bar()
    rows = []

    def child(folder: str, mode: str, experts: list[str]) -> float:
        ranks = 2 if mode.endswith("fsdp") else 1
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536",  # freed tensors go back to the OS: resident memory tracks live tensors
               "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000)}
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, folder, mode, json.dumps(experts), str(a.micro_batch), str(a.seq_len)], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(ranks)]
        out = [p.communicate() for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit("".join(err[-2000:] for _, err in out))
        return json.loads(out[0][0].strip().splitlines()[-1])["measured"] / 2**20  # rank 0

    runtime = {kind: child("", kind, []) for kind in ("runtime", "runtime-fsdp")}
    print(f"the runtime's own memory (3 steps of a model with next to no tensors): {runtime['runtime']:.1f} MiB, {runtime['runtime-fsdp']:.1f} MiB a rank under FSDP; taken off every measurement\n")
    print(f"{'preset':18} {'mode':22} {'estimated MiB':>14} {'measured MiB':>13} {'est / meas':>11}")
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
        plan = memory_plan(params, model.config, model.config.intermediate_size, a.micro_batch, a.seq_len, 16, (per_rank, linear), devices=2)
        del model, probe
        for mode, row in (("full", "fp32 AdamW"), ("fsdp", "FSDP x2, fp32"), ("lora", "LoRA r16"), ("lora-int8", "LoRA r16, int8 base")):
            measured = child(folder, mode, experts) - runtime["runtime-fsdp" if mode == "fsdp" else "runtime"]
            estimated = plan[row]["total"] * 1024
            rows.append({"preset": preset, "mode": row, "params": params, "estimated_mib": estimated, "measured_mib": measured, "runtime_mib": runtime["runtime-fsdp" if row.startswith("FSDP") else "runtime"], "ratio": estimated / measured})
            print(f"{preset:18} {row:22} {estimated:>14.1f} {measured:>13.1f} {estimated / measured:>11.2f}")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "memory_plan.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps({**r, "micro_batch": a.micro_batch, "seq_len": a.seq_len, "at": time.time()}) + "\n")
    print(f"\nreproduce: .venv/bin/python bench/memory_plan.py --presets {a.presets} --micro-batch {a.micro_batch} --seq-len {a.seq_len}")


if __name__ == "__main__":
    main()
