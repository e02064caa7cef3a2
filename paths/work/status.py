"""`paths status`: every path of the run with its claim, lease, checkpoints and progress."""

from __future__ import annotations

import time
from typing import Any

from paths.work.claims import claimable, read_claim
from storage.layout import Run


def status(run: Run) -> list[dict[str, Any]]:
    """One row per decomposed path and per registered domain expert."""
    from paths.units import units

    ids = units(run)
    now = time.time()
    rows = []
    for pid in ids:
        record, _ = read_claim(run, pid)
        committed = [s for s, c in run.checkpoints(pid) if c]
        state = "unclaimed" if record is None else record.get("state", "?")
        expires = record.get("expires_at") if record else None
        if state == "claimed" and claimable(record, now):
            state = "expired"
        rows.append({
            "path": pid,
            "state": state,
            "worker": (record or {}).get("worker"),
            "generation": (record or {}).get("generation"),
            "lease_left_s": round(expires - now, 1) if state == "claimed" and expires else None,
            "committed_step": committed[-1] if committed else None,
            "step": (record or {}).get("step"),
            "tokens": (record or {}).get("tokens"),
            "loss": (record or {}).get("loss"),
            "final": run.store.exists(f"{run.final(pid)}/manifest.json"),
        })
    return rows
