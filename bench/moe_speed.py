"""MoE block speed: transformers' own MoE forward vs the pure-torch reference vs megablocks.

    .venv/bin/python bench/moe_speed.py [--preset dipaco-16x16-150m] [--batch 8] [--seq-len 512] [--steps 10]

Builds the preset's MoE (random weights, bf16 on CUDA, float32 on CPU), then times forward +
backward of the whole model for each implementation of the MoE blocks (`experts/moe.py`), in the
same process, alternating, after one warm-up step each. Prints tokens/s and the ratios against
transformers' own block (the named peer); megablocks only where CUDA and the package are present.
Appended to bench/out/moe_speed.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="dipaco-16x16-150m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()

    import torch

    from experts.moe import megablocks_available, patched
    from paths.base import build_model, load_spec, preset_path

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    spec = load_spec(preset_path(args.preset), args.preset)
    model = build_model(spec, 0).to(device, dtype).train()
    family = spec.family
    x = torch.randint(3, model.config.vocab_size, (args.batch, args.seq_len), device=device)
    impls = {"transformers": contextlib.nullcontext, "reference": lambda: patched(model, family, "reference")}
    if megablocks_available():
        impls["megablocks"] = lambda: patched(model, family, "megablocks")

    def step() -> None:
        loss = model(input_ids=x).logits.float().logsumexp(-1).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    seconds = {k: 0.0 for k in impls}
    for name, ctx in impls.items():  # warm-up (and, for megablocks, kernel selection)
        with ctx():
            step()
    for _ in range(args.steps):
        for name, ctx in impls.items():
            with ctx() as found:
                if cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                step()
                if cuda:
                    torch.cuda.synchronize()
                seconds[name] += time.perf_counter() - t
                for b in found or []:
                    b.logits.clear()
    tokens = args.batch * args.seq_len * args.steps
    rates = {k: tokens / v for k, v in seconds.items()}
    device_name = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    print(f"{args.preset} on {device_name}, {dtype}, batch {args.batch} x {args.seq_len}, forward + backward, {args.steps} steps each")
    for k, r in rates.items():
        print(f"  {k:13s} {r:12,.0f} tok/s   {r / rates['transformers']:.2f}x transformers' MoE")
    print(f"reproduce: .venv/bin/python bench/moe_speed.py --preset {args.preset} --batch {args.batch} --seq-len {args.seq_len} --steps {args.steps}")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "moe_speed.jsonl"), "a") as f:
        f.write(json.dumps({"at": time.time(), "args": vars(args), "device": device_name, "tokens_per_s": rates}) + "\n")


if __name__ == "__main__":
    main()
