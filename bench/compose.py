"""`paths compose --into moe` against `mergekit-moe` and `cp`, on the same expert checkpoints.

    .venv/bin/python bench/compose.py [--preset bench-mixtral] [--work bench/out/compose]

A one-level plan of the preset (4 experts, the BTX case) gives 4 paths; each is materialized and
perturbed (a "trained" expert) and committed as work/<path>/final/. Then, each in its own process:
- ours: `compose_moe()` reads base/ and the 4 finals by ranged reads, writes composed/<name>/;
- mergekit-moe (gate_mode random, float32) builds a Mixtral from the same 4 dense checkpoints,
  with path p00's as the base model;
- cp: copies the bytes ours reads (base/ weights and the 4 finals) to a scratch folder.
Printed: seconds and peak RSS of each, ours / mergekit (goal <= 0.5 both) and ours / cp
(goal <= 1.5). Appended to bench/out/compose.jsonl.
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

PEAK = "int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]) * 1024"


def prepare(work: str, preset: str) -> list[str]:
    import torch
    from safetensors.torch import load_file, save_file

    from paths.prepare.init import init_run
    from paths.prepare.decompose import decompose
    from paths.models import materialize
    from storage.layout import open_run
    from storage.manifest import ArtifactWriter

    url = os.path.join(work, "run")
    init_run(url, preset=preset, seed=0)
    run = open_run(url)
    ids = decompose(run, 1)["paths"]
    folders = []
    for i, pid in enumerate(ids):
        folder = os.path.join(work, "experts", pid)
        materialize(run, pid, folder)
        weights = load_file(os.path.join(folder, "model.safetensors"))
        g = torch.Generator().manual_seed(i)
        weights = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
        save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        json.dump({"path": pid, "tokens": 1000 * (i + 1), "steps": 1}, open(os.path.join(folder, "provenance.json"), "w"))
        writer = ArtifactWriter(run.store, run.final(pid))
        for name in sorted(os.listdir(folder)):
            writer.upload(name, os.path.join(folder, name))
        writer.commit(kind="final")
        folders.append(folder)
    return folders


def child(code: str) -> tuple[float, int]:
    """(seconds, peak RSS) of Python code run in a fresh process (imports before the timer)."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["seconds"], out["rss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "compose"))
    parser.add_argument("--preset", default="bench-mixtral")
    a = parser.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    folders = prepare(a.work, a.preset)
    run_dir = os.path.join(a.work, "run")

    ours = (
        "import json, time, sys; from compose.merge import compose_moe; from storage.layout import open_run\n"
        f"run = open_run({run_dir!r}); t = time.perf_counter(); compose_moe(run, 'bench', overwrite=True)\n"
        f"print(json.dumps({{'seconds': time.perf_counter() - t, 'rss': {PEAK}}}))"
    )
    config = os.path.join(a.work, "moe.yml")
    with open(config, "w") as f:
        f.write(f"base_model: {folders[0]}\ngate_mode: random\ndtype: float32\nexperts_per_token: 2\nexperts:\n")
        f.writelines(f"  - source_model: {d}\n" for d in folders)
    out_dir = os.path.join(a.work, "mergekit-out")
    mergekit = (
        "import json, sys, time; from mergekit.scripts.moe import main\n"
        f"sys.argv = ['mergekit-moe', {config!r}, {out_dir!r}, '--i-understand-this-is-not-useful-without-training', '--lazy-unpickle', '--no-copy-tokenizer', '--allow-crimes']\n"
        "t = time.perf_counter()\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        f"print(json.dumps({{'seconds': time.perf_counter() - t, 'rss': {PEAK}}}))"
    )
    base_files = sorted(os.path.join(run_dir, "base", f) for f in os.listdir(os.path.join(run_dir, "base")) if f.endswith(".safetensors"))
    inputs = base_files + [os.path.join(d, "model.safetensors") for d in folders]
    scratch = os.path.join(a.work, "cp")
    os.makedirs(scratch)
    cp_code = (
        "import json, subprocess, time\n"
        f"t = time.perf_counter()\n"
        f"[subprocess.run(['cp', p, {scratch!r} + f'/f{{i}}.safetensors'], check=True) for i, p in enumerate({inputs!r})]\n"
        f"print(json.dumps({{'seconds': time.perf_counter() - t, 'rss': {PEAK}}}))"
    )
    results = {}
    for name, code in (("mergekit", mergekit), ("ours", ours), ("cp", cp_code)):
        os.sync()  # nobody pays for the previous step's dirty pages
        results[name] = child(code)
    nbytes = sum(os.path.getsize(p) for p in inputs)
    composed = os.path.join(run_dir, "composed", "bench")
    out_bytes = sum(os.path.getsize(os.path.join(composed, f)) for f in os.listdir(composed) if f.endswith(".safetensors"))
    row = {
        "preset": a.preset, "experts": len(folders), "bytes_read": nbytes, "bytes_written": out_bytes, "cpus": os.cpu_count(),
        **{f"{k}_seconds": v[0] for k, v in results.items()}, **{f"{k}_rss": v[1] for k, v in results.items()},
        "time_vs_mergekit": results["ours"][0] / results["mergekit"][0], "rss_vs_mergekit": results["ours"][1] / results["mergekit"][1],
        "time_vs_cp": results["ours"][0] / results["cp"][0],
    }
    print(f"{a.preset}: 4 experts, reading {nbytes / 1e9:.2f} GB, writing {out_bytes / 1e9:.2f} GB; {os.cpu_count()} CPUs")
    for k, (s, rss) in results.items():
        print(f"  {k:9s} {s:7.2f} s   peak RSS {rss / 2**20:7.0f} MiB")
    print(f"ours / mergekit-moe: time {row['time_vs_mergekit']:.2f}x (goal <= 0.5), peak RSS {row['rss_vs_mergekit']:.2f}x (goal <= 0.5)")
    print(f"ours / cp of the bytes read: time {row['time_vs_cp']:.2f}x (goal <= 1.5)")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "compose.jsonl"), "a") as f:
        f.write(json.dumps({"at": time.time(), **row}) + "\n")


if __name__ == "__main__":
    main()
