"""GRPO with `paths train --mode grpo` against TRL's `GRPOTrainer`, on CPU.

    .venv/bin/python bench/grpo.py [--steps 20] [--prompts 4] [--group 8] [--max-new-tokens 32]

The same tiny model (the tiny-mixtral path p00, 189K parameters, fp32), the same generated
arithmetic prompts, group size, completion length, sampling (temperature 1, top-p 1), reward
(`format`), loss (`grpo`, beta 0, one iteration) and learning rate. Each trainer runs in its own
process, imports done before timing; timed: loading the model and building the trainer (ours:
materializing the path from base/), then training (generation, scoring, backward, optimizer), and
ours also writes its final checkpoint. Reported: completions/s and optimizer steps/s,
their ratios ours / TRL (goal >= 1.5) and each process's peak RSS. Appended to bench/out/grpo.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def vmhwm() -> int:
    return int([line for line in open("/proc/self/status") if line.startswith("VmHWM")][0].split()[1]) * 1024


def prepare(work: str, n_prompts: int) -> None:
    from paths.prepare.init import init_run
    from paths.prepare.decompose import decompose
    from paths.models import materialize
    from paths.work.tasks import arithmetic, write_jsonl
    from sharding.shard import ShardOptions, shard
    from storage.layout import open_run

    url = os.path.join(work, "run")
    init_run(url, preset="tiny-mixtral", seed=0)
    run = open_run(url)
    decompose(run, 1)
    tasks = os.path.join(work, "tasks.jsonl")
    write_jsonl(arithmetic(n_prompts, [1, 2]), tasks)
    mapping = os.path.join(work, "map.json")
    json.dump({"all": "p00"}, open(mapping, "w"))
    with open(tasks) as f:
        rows = [json.loads(x) | {"domain": "all"} for x in f]
    with open(tasks, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    shard(run, ShardOptions(dataset="rl", inputs=[tasks], kind="prompts", text_field="prompt", id_field="id", router="domain", domain_field="domain", domain_map=mapping, holdout=0.0))
    materialize(run, "p00", os.path.join(work, "p00"))


def child_ours(work: str, a) -> dict:
    from paths.work.train import train
    from paths.train_config import load_config
    from storage.layout import open_run

    import accelerate  # noqa: F401  (imports are outside the timed part, as TRL's are)
    import transformers.models.mistral.modeling_mistral  # noqa: F401
    import zarr  # noqa: F401

    import paths.work.grpo  # noqa: F401
    import sharding.dataset  # noqa: F401

    run = open_run(os.path.join(work, "run"))
    run.store.delete_prefix("work")
    cfg = load_config(sets=[f"batch_size={a.prompts}", f"group_size={a.group}", f"max_new_tokens={a.max_new_tokens}", "warmup_steps=0", "lr=1e-5", "checkpoint_every=0", "loss=grpo"], steps=a.steps)
    t = time.perf_counter()
    train(run, "p00", "grpo", "rl", cfg, None, show_progress=False, rewards=["format"])
    return {"seconds": time.perf_counter() - t, "rss": vmhwm()}


def child_trl(work: str, a) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from paths.work.rewards import format_reward

    hf_logging.set_verbosity_error()
    folder = os.path.join(work, "p00")
    rows = [json.loads(x) for x in open(os.path.join(work, "tasks.jsonl"))]
    ds = datasets.Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
    t = time.perf_counter()  # like ours: loading the model and building the trainer are counted
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    def reward(prompts, completions, **kwargs):
        return format_reward(prompts, completions, [""] * len(completions))

    args = GRPOConfig(
        output_dir=os.path.join(work, "trl-out"), per_device_train_batch_size=a.prompts * a.group, num_generations=a.group,
        gradient_accumulation_steps=1, max_steps=a.steps, max_completion_length=a.max_new_tokens, temperature=1.0, top_p=1.0,
        beta=0.0, loss_type="grpo", learning_rate=1e-5, warmup_steps=0, use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=a.steps, disable_tqdm=True, seed=0, bf16=False, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=ds, processing_class=tok)
    trainer.train()
    return {"seconds": time.perf_counter() - t, "rss": vmhwm()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "grpo"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--child", choices=["ours", "trl"])
    a = parser.parse_args()
    if a.child:
        out = (child_ours if a.child == "ours" else child_trl)(a.work, a)
        print(json.dumps(out))
        return
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    prepare(a.work, 200)
    results = {}
    for who in ("trl", "ours"):
        proc = subprocess.run([sys.executable, __file__, "--child", who, "--work", a.work, "--steps", str(a.steps), "--prompts", str(a.prompts), "--group", str(a.group), "--max-new-tokens", str(a.max_new_tokens)], cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{who} failed:\n{proc.stderr[-3000:]}")
        results[who] = json.loads(proc.stdout.strip().splitlines()[-1])
    completions = a.steps * a.prompts * a.group
    row = {
        "steps": a.steps, "prompts_per_step": a.prompts, "group": a.group, "max_new_tokens": a.max_new_tokens, "cpus": os.cpu_count(),
        **{f"{w}_{k}": v for w, r in results.items() for k, v in r.items()},
        "completions_per_s_ours": completions / results["ours"]["seconds"], "completions_per_s_trl": completions / results["trl"]["seconds"],
        "ratio": results["trl"]["seconds"] / results["ours"]["seconds"], "rss_ratio": results["ours"]["rss"] / results["trl"]["rss"],
    }
    print(f"GRPO on tiny-mixtral p00 (189K params, fp32, CPU x{os.cpu_count()}): {a.steps} steps x {a.prompts} prompts x G={a.group}, <= {a.max_new_tokens} new tokens, reward format, loss grpo, beta 0")
    print(f"paths train --mode grpo  {row['completions_per_s_ours']:8.1f} completions/s  {a.steps / results['ours']['seconds']:.3f} steps/s  peak RSS {results['ours']['rss'] / 2**20:.0f} MiB")
    print(f"TRL GRPOTrainer          {row['completions_per_s_trl']:8.1f} completions/s  {a.steps / results['trl']['seconds']:.3f} steps/s  peak RSS {results['trl']['rss'] / 2**20:.0f} MiB")
    print(f"ratio ours / TRL: {row['ratio']:.2f}x throughput (goal >= 1.5), {row['rss_ratio']:.2f}x peak RSS")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "grpo.jsonl"), "a") as f:
        f.write(json.dumps({"at": time.time(), **row}) + "\n")


if __name__ == "__main__":
    main()
