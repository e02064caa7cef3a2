"""Materializing one path of `dipaco-16x16-150m` (16 experts x 12 layers, ~146M params per path,
bf16) from a local base and from a SeaweedFS base, against copying the same number of bytes.

    .venv/bin/python bench/materialize.py [--work bench/out/materialize] [--repeats 3]

Peers, measured in the same run and alternated with ours:
- local: `cp` of a file holding exactly the path's bytes, on the same disk;
- S3: s3fs `get_file` (what `aws s3 cp` does) of an object holding exactly the path's bytes.
Reported: MB/s of ours and of the peer, their ratio (goal >= 0.7), and the peak RSS of the
`paths materialize` process against the path's size (goal <= 1.5x). Results are appended as JSON
lines to bench/out/materialize.jsonl. The base is built once and reused from --work.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from storage.s3 import make_s3fs  # noqa: E402
from storage.seaweed import start_seaweed  # noqa: E402

PATH = "p03-11"
PATHS_CLI = [sys.executable, "-m", "cli.main"]


# The library call inside a fresh process: its own timer (the operation), the process's wall time
# (with interpreter start-up, as a user runs the CLI) and its peak RSS.
# Peak RSS is the child's own VmHWM, which exec resets (ru_maxrss would also count the pages of
# the forked bench process before exec).
CHILD = (
    "import json, sys; from paths.decompose import materialize; from storage.layout import open_run; "
    "out = materialize(open_run(sys.argv[1]), sys.argv[2], sys.argv[3]); "
    "out['vmhwm_kb'] = int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]); "
    "print(json.dumps(out))"
)


def run_child(url: str, out: str, env: dict | None = None) -> tuple[float, float, int]:
    """(seconds in materialize(), seconds of the whole process, its peak RSS in bytes)."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, url, PATH, out], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    stdout = proc.stdout.read()
    proc.wait()
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"materialize of {url} failed with exit code {proc.returncode}")
    out = json.loads(stdout.splitlines()[-1])
    return out["seconds"], wall, out["vmhwm_kb"] * 1024


def ensure_local_run(work: str) -> str:
    """A local run with the dipaco base, decomposed with 2 levels (built once)."""
    run = os.path.join(work, "run")
    if not os.path.exists(os.path.join(run, "paths", PATH, "path.json")):
        shutil.rmtree(run, ignore_errors=True)
        print("building the dipaco-16x16-150m base (once)...", flush=True)
        t = time.perf_counter()
        subprocess.run(PATHS_CLI + ["init", run, "--preset", "dipaco-16x16-150m"], cwd=ROOT, check=True)
        subprocess.run(PATHS_CLI + ["decompose", run, "--levels", "2", "--paths", PATH], cwd=ROOT, check=True)
        print(f"built in {time.perf_counter() - t:.0f}s", flush=True)
    return run


def measure(label: str, url: str, peer, env: dict | None, out_dir: str, repeats: int) -> dict:
    """Alternate ours and the peer; medians of seconds, max of our RSS."""
    ours_s, wall_s, peer_s, rss = [], [], [], []
    for _ in range(repeats):
        shutil.rmtree(out_dir, ignore_errors=True)
        s, w, r = run_child(url, out_dir, env)
        ours_s.append(s)
        wall_s.append(w)
        rss.append(r)
        peer_s.append(peer())
    nbytes = os.path.getsize(os.path.join(out_dir, "model.safetensors"))
    mb_s = lambda xs: nbytes / statistics.median(xs) / 1e6
    return {
        "backend": label,
        "path_bytes": nbytes,
        "ours_mb_s": round(mb_s(ours_s), 1),
        "ours_process_mb_s": round(mb_s(wall_s), 1),
        "peer_mb_s": round(mb_s(peer_s), 1),
        "ratio": round(mb_s(ours_s) / mb_s(peer_s), 3),
        "ratio_with_startup": round(mb_s(wall_s) / mb_s(peer_s), 3),
        "peak_rss_mb": round(max(rss) / 1e6, 1),
        "rss_over_path": round(max(rss) / nbytes, 3),
        "ours_s": [round(x, 3) for x in ours_s],
        "rss_mb": [round(x / 1e6, 1) for x in rss],
        "peer_s": [round(x, 3) for x in peer_s],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "materialize"))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cmd = "python bench/materialize.py " + " ".join(sys.argv[1:])
    os.makedirs(args.work, exist_ok=True)
    run = ensure_local_run(args.work)
    rows = []

    # Local: ours vs cp of a file holding exactly the path's bytes.
    out = os.path.join(args.work, "out-local")
    sample = os.path.join(args.work, "same-bytes.bin")
    subprocess.run(PATHS_CLI + ["materialize", run, "--path", PATH, "--out", out], cwd=ROOT, check=True, capture_output=True)
    shutil.copyfile(os.path.join(out, "model.safetensors"), sample)

    def cp() -> float:
        t = time.perf_counter()
        subprocess.run(["cp", sample, sample + ".copy"], check=True)
        return time.perf_counter() - t

    local = measure("local", run, cp, None, out, args.repeats)
    rows.append({"bench": "materialize", "peer": "cp", **local})
    print(f"local: ours {local['ours_mb_s']} MB/s ({local['ours_process_mb_s']} with process start-up), cp {local['peer_mb_s']} MB/s "
          f"-> ratio {local['ratio']} ({local['ratio_with_startup']}); "
          f"peak RSS {local['peak_rss_mb']} MB = {local['rss_over_path']}x the path ({local['path_bytes'] / 1e6:.0f} MB)", flush=True)

    with start_seaweed() as server:
        env = {**os.environ, **server.env()}
        url = "s3://bench/dipaco"
        print("copying the base to SeaweedFS...", flush=True)
        subprocess.run(PATHS_CLI + ["init", url, "--from", os.path.join(run, "base"), "--tokenizer", os.path.join(run, "tokenizer")], cwd=ROOT, env=env, check=True, capture_output=True)
        subprocess.run(PATHS_CLI + ["decompose", url, "--levels", "2", "--paths", PATH], cwd=ROOT, env=env, check=True, capture_output=True)
        fs = make_s3fs(server.storage_options)
        fs.put_file(sample, "bench/same-bytes.bin")

        def s3_get() -> float:
            t = time.perf_counter()
            fs.get_file("bench/same-bytes.bin", sample + ".s3copy")
            return time.perf_counter() - t

        out = os.path.join(args.work, "out-s3")
        s3 = measure("seaweedfs", url, s3_get, env, out, args.repeats)
        rows.append({"bench": "materialize", "peer": "s3fs get_file", **s3})
        print(f"s3:    ours {s3['ours_mb_s']} MB/s ({s3['ours_process_mb_s']} with process start-up), s3fs get_file {s3['peer_mb_s']} MB/s "
              f"-> ratio {s3['ratio']} ({s3['ratio_with_startup']}); "
              f"peak RSS {s3['peak_rss_mb']} MB = {s3['rss_over_path']}x the path", flush=True)
    for f in (sample + ".copy", sample + ".s3copy"):
        if os.path.exists(f):
            os.remove(f)
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "materialize.jsonl"), "a") as f:
        for row in rows:
            f.write(json.dumps({**row, "command": cmd, "time": time.time()}) + "\n")
    print(f"reproduce: {cmd}")


if __name__ == "__main__":
    main()
