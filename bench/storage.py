"""Storage throughput and claim latency against a real S3 server (SeaweedFS on loopback).

    .venv/bin/python bench/storage.py [--objects 100] [--rounds 3] [--writers 16] [--races 30]

1. 1 MiB puts and gets through `storage/` vs raw s3fs (the peer), alternating rounds in one run,
   reported as MiB/s and as the ratio ours / s3fs (goal >= 0.9).
2. `put_if_absent` latency with 16 concurrent writer processes racing for the same key each
   round (one winner, the rest get 412): p50 / p99, on S3 and on a local folder.
Results are printed and appended as JSON lines to bench/out/storage.jsonl.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from storage.s3 import make_s3fs  # noqa: E402
from storage.seaweed import start_seaweed  # noqa: E402
from storage.url import open_store  # noqa: E402

MiB = 1 << 20


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def throughput(server, objects: int, rounds: int) -> dict:
    """MiB/s of puts and gets, ours vs raw s3fs, median over alternating rounds."""
    ours = open_store("s3://bench/ours", server.storage_options, create=True)
    raw = make_s3fs(server.storage_options)
    raw.retries = 5  # s3fs as users run it
    payload = [os.urandom(MiB) for _ in range(8)]
    results: dict[str, list[float]] = {k: [] for k in ("ours_put", "s3fs_put", "ours_get", "s3fs_get")}
    for r in range(rounds):
        keys = [f"r{r}/obj-{i:04d}" for i in range(objects)]
        steps = {
            "s3fs_put": lambda: [raw.pipe_file(f"bench/raw/{k}", payload[i % 8]) for i, k in enumerate(keys)],
            "ours_put": lambda: [ours.write(k, payload[i % 8]) for i, k in enumerate(keys)],
            "s3fs_get": lambda: [raw.cat_file(f"bench/raw/{k}") for k in keys],
            "ours_get": lambda: [ours.read(k) for k in keys],
        }
        # Alternate who goes first so neither side always meets a warmer server.
        order = ["s3fs_put", "ours_put", "s3fs_get", "ours_get"] if r % 2 == 0 else ["ours_put", "s3fs_put", "ours_get", "s3fs_get"]
        for name in order:
            results[name].append(timed(steps[name]))
    mibs = {k: objects / statistics.median(v) for k, v in results.items()}
    return {
        "objects_per_round": objects,
        "rounds": rounds,
        **{f"{k}_mib_s": round(v, 1) for k, v in mibs.items()},
        "put_ratio": round(mibs["ours_put"] / mibs["s3fs_put"], 3),
        "get_ratio": round(mibs["ours_get"] / mibs["s3fs_get"], 3),
    }


def _writer(url, options, me, races, barrier, out) -> None:
    from paths.errors import PreconditionFailed

    store = open_store(url, options)
    lat = []
    for r in range(races):
        barrier.wait()
        t = time.perf_counter()
        try:
            store.put_if_absent(f"claims/race-{r}.json", f"w{me}".encode())
        except PreconditionFailed:
            pass
        lat.append(time.perf_counter() - t)
    out.put(lat)


def claim_latency(url: str, options, writers: int, races: int) -> dict:
    """p50 / p99 of put_if_absent with `writers` processes racing on one key per round."""
    open_store(url, options, create=True)
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(writers), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(url, options, i, races, barrier, out)) for i in range(writers)]
    for p in procs:
        p.start()
    lat = sorted(x for _ in procs for x in out.get(timeout=600))
    for p in procs:
        p.join()
    q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))] * 1000
    store = open_store(url, options)
    winners = {store.read(f"claims/race-{r}.json") for r in range(races)}
    return {"writers": writers, "races": races, "calls": len(lat), "p50_ms": round(q(0.5), 2),
            "p99_ms": round(q(0.99), 2), "share_over_500ms": round(sum(x > 0.5 for x in lat) / len(lat), 3),
            "keys_with_one_winner": len(winners)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--writers", type=int, default=16)
    ap.add_argument("--races", type=int, default=30)
    args = ap.parse_args()
    cmd = "python bench/storage.py " + " ".join(sys.argv[1:])
    rows = []
    with start_seaweed() as server:
        tp = throughput(server, args.objects, args.rounds)
        rows.append({"bench": "storage.throughput_1mib", "peer": "s3fs", **tp})
        print(f"1 MiB puts: ours {tp['ours_put_mib_s']} MiB/s, s3fs {tp['s3fs_put_mib_s']} MiB/s -> ratio {tp['put_ratio']}")
        print(f"1 MiB gets: ours {tp['ours_get_mib_s']} MiB/s, s3fs {tp['s3fs_get_mib_s']} MiB/s -> ratio {tp['get_ratio']}")
        s3 = claim_latency(f"s3://bench/claims-{int(time.time())}", server.storage_options, args.writers, args.races)
        rows.append({"bench": "storage.put_if_absent_latency", "backend": "seaweedfs", **s3})
        print(f"put_if_absent, {args.writers} racing writers on SeaweedFS: p50 {s3['p50_ms']} ms, p99 {s3['p99_ms']} ms, "
              f"{s3['share_over_500ms']:.1%} over 500 ms")
        solo = claim_latency(f"s3://bench/solo-{int(time.time())}", server.storage_options, 1, args.races)
        rows.append({"bench": "storage.put_if_absent_latency", "backend": "seaweedfs", **solo})
        print(f"put_if_absent, 1 writer on SeaweedFS: p50 {solo['p50_ms']} ms, p99 {solo['p99_ms']} ms")
    with tempfile.TemporaryDirectory() as d:
        local = claim_latency(os.path.join(d, "run"), None, args.writers, args.races)
        rows.append({"bench": "storage.put_if_absent_latency", "backend": "local", **local})
        print(f"put_if_absent, {args.writers} racing writers on a local folder: p50 {local['p50_ms']} ms, p99 {local['p99_ms']} ms")
    os.makedirs("bench/out", exist_ok=True)
    with open("bench/out/storage.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps({**row, "command": cmd, "time": time.time()}) + "\n")
    print(f"reproduce: {cmd}")


if __name__ == "__main__":
    main()
