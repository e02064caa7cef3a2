"""A process that waits at a barrier, then tries to create one key (for the race tests)."""

from __future__ import annotations

import time


def race(url: str, options: dict | None, key: str, me: int, barrier, results) -> None:
    """Report (me, won, latency_s) after one put_if_absent."""
    from paths.errors import PreconditionFailed
    from storage.url import open_store

    store = open_store(url, options)
    barrier.wait()
    t = time.perf_counter()
    try:
        store.put_if_absent(key, f"worker-{me}".encode())
        won = True
    except PreconditionFailed:
        won = False
    results.put((me, won, time.perf_counter() - t))
