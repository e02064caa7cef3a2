"""`paths next-round`: a composed model becomes the base of the next round (DiLoCo's outer loop).

Round r's base/, paths/, claims/ and work/ are copied to rounds/r<r>/ (kept read-only from then on)
and cleared; composed/<name>/ becomes base/ (with per-tensor hashes, as `paths init` writes it);
the same paths are decomposed again against the new base, so `paths claim && paths train` start
round r + 1. data/, router/ and composed/ are shared by all rounds; a compose of round r + 1 with
`--previous <name>` continues the outer momentum.
"""

from __future__ import annotations

from typing import Any

from paths.errors import ConfigurationError, NotFound
from storage.layout import Run

ARCHIVED = ("base", "paths", "claims", "work")


def next_round(run: Run, composed: str) -> dict[str, Any]:
    """Archive the current round and start the next one from composed/<composed>/."""
    from paths.prepare.init import write_base
    from paths.models import fetch_dir
    from paths.prepare.decompose import decompose
    from paths.units import decomposed_paths, run_plan
    from storage.manifest import read_manifest

    meta = run.read_meta()
    prefix = run.composed(composed)
    try:
        record = read_manifest(run.store, prefix)
    except NotFound:
        raise NotFound(f"no composed model {composed!r} in {run.url}: run `paths compose {run.url} --name {composed}` first") from None
    if record.get("kind") != "composed":
        raise ConfigurationError(f"{run.store.url_of(prefix)} is not a composed model")
    live = [c for c in _claims(run) if c.get("state") == "claimed"]
    if live:
        raise ConfigurationError(f"path {live[0]['path']} is still being trained (claimed by {live[0].get('worker')}): wait, or `paths release` it first")
    plan, family, _ = run_plan(run)
    _, ids = decomposed_paths(run)
    r = int(meta.get("round", 1))
    folder = fetch_dir(run, prefix)  # the composed checkpoint, locally (verified)
    archive = f"rounds/r{r}"
    for area in ARCHIVED:
        for obj in run.store.list(area):
            run.store.copy(obj.key, f"{archive}/{obj.key}")
    for area in ARCHIVED:
        run.store.delete_prefix(area)
    base = write_base(run, folder, family, f"composed:{composed} (round {r})")
    history = meta.get("rounds", []) + [{"round": r, "base": meta["base"], "composed": composed, "archive": archive}]
    run.update_meta(base=base, round=r + 1, rounds=history)
    decompose(run, plan.levels, ",".join(ids) if len(ids) < plan.num_paths else "all")
    return {"round": r + 1, "archive": archive, "paths": len(ids), "base_checksum": base["checksum"]}


def _claims(run: Run) -> list[dict[str, Any]]:
    from storage.admin import claims

    return claims(run)
