"""The lm/sft loss through the head a chunk at a time (paths/head_loss.py) against the whole-logits
loss HF Trainer computes (the model's logits, then cross-entropy): peak memory and seconds of one
forward + backward, on a model with a large vocabulary, where the logits dominate.

    .venv/bin/python bench/head_loss.py [--vocab 50304] [--batch 4] [--seq-len 1024] [--repeats 2]

A Mistral of hidden 256, 2 layers, the given vocabulary; each arm runs in a process of its own
(peak RSS is per process), alternating `--repeats` times, glibc's default allocator in both (so
the peak is what the step holds, not what an allocator keeps). Appended to bench/out/head_loss.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def one(arm: str, vocab: int, batch: int, seq_len: int) -> dict:
    """One arm in this process: 1 warm-up step, then 3 timed; peak RSS after them."""
    import resource

    import torch
    from transformers import MistralConfig, MistralForCausalLM

    import paths.steps as steps

    if arm == "whole":  # the whole-logits route, as for a model head_loss does not split
        steps.fusable = lambda model: False
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                             head_dim=32, max_position_embeddings=seq_len))
    b = {"tokens": torch.randint(0, vocab, (batch, seq_len + 1)), "valid": torch.full((batch,), seq_len + 1)}
    times = []
    for i in range(4):
        t = time.perf_counter()
        steps.micro_loss(model, b, batch * seq_len).backward()
        model.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t)
    return {"arm": arm, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "step_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--arm", choices=["whole", "chunked"], help=argparse.SUPPRESS)  # one run in a process of its own
    a = ap.parse_args()
    if a.arm:
        print(json.dumps(one(a.arm, a.vocab, a.batch, a.seq_len)))
        return
    runs: dict[str, list[dict]] = {"whole": [], "chunked": []}
    for r in range(a.repeats):
        for arm in ("whole", "chunked") if r % 2 == 0 else ("chunked", "whole"):
            cmd = [sys.executable, os.path.abspath(__file__), "--arm", arm, "--vocab", str(a.vocab), "--batch", str(a.batch), "--seq-len", str(a.seq_len)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "PATHS_MALLOC": "system"})
            runs[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {arm: {k: statistics.median(x[k] for x in v) for k in ("peak_mib", "step_s")} for arm, v in runs.items()}
    logits_mib = a.batch * a.seq_len * a.vocab * 4 / 2**20
    print(f"Mistral hidden 256 x 2 layers, vocabulary {a.vocab:,}; {a.batch} x {a.seq_len} tokens (fp32 logits {logits_mib:,.0f} MiB); medians of {a.repeats} runs each")
    print(f"whole logits (HF Trainer's loss)   peak RSS {med['whole']['peak_mib']:7,.0f} MiB   forward + backward {med['whole']['step_s']:.2f} s")
    print(f"chunked (paths/head_loss.py)       peak RSS {med['chunked']['peak_mib']:7,.0f} MiB   forward + backward {med['chunked']['step_s']:.2f} s")
    print(f"peak memory ratio {med['chunked']['peak_mib'] / med['whole']['peak_mib']:.2f}x, speed {med['whole']['step_s'] / med['chunked']['step_s']:.2f}x the whole-logits loss")
    print(f"reproduce: .venv/bin/python bench/head_loss.py --vocab {a.vocab} --batch {a.batch} --seq-len {a.seq_len} --repeats {a.repeats}")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "head_loss.jsonl"), "a") as f:
        f.write(json.dumps({"time": time.time(), "settings": vars(a), "runs": runs, "median": med}) + "\n")


if __name__ == "__main__":
    main()
