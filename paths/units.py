"""The registry of units: what a run holds to be trained, and where each unit's data lies.

A unit is a decomposed path (an id like `p03-11`, cut from the base by the run's plan) or a
registered domain expert (`experts/<name>/`). Both are claimed, trained and composed alike; this
module answers which units exist, what each is, its step budget and the shard it reads.
"""

from __future__ import annotations

import json
import re
from typing import Any

from paths.base import base_config, require_base
from paths.errors import ConfigurationError, IntegrityError, NotFound
from paths.families import Family, get_family
from paths.plan import Plan
from storage.layout import Run
from storage.manifest import read_manifest, read_verified

PATH_ID = re.compile(r"p\d+(-\d+)*")  # a path of the plan; an expert name never looks like one


def run_plan(run: Run, levels: int | None = None) -> tuple[Plan, Family, dict[str, Any]]:
    """The run's plan (from run.json, or a new one with `levels`), family and base config."""
    meta = require_base(run)
    family = get_family(meta["base"]["family"])
    config = base_config(run)
    if levels is None:
        if "plan" not in meta:
            raise ConfigurationError(f"{run.url} is not decomposed yet: run `paths decompose {run.url} --levels G`")
        levels = meta["plan"]["levels"]
    return family.plan(config, levels), family, config


def read_path(run: Run, path_id: str) -> dict[str, Any]:
    """paths/<id>/path.json, checked against the paths manifest and the current base."""
    plan, _, _ = run_plan(run)
    plan.parse(path_id)
    try:
        record = json.loads(read_verified(run.store, "paths", f"{path_id}/path.json"))
    except IntegrityError as exc:
        if "is not listed" in str(exc):
            raise ConfigurationError(f"path {path_id} was not decomposed in {run.url}: run `paths decompose {run.url} --levels {plan.levels} --paths {path_id}`") from None
        raise
    if record["base_checksum"] != run.read_meta()["base"]["checksum"]:
        raise IntegrityError(f"path {path_id} was cut from another base (checksum differs): decompose again")
    return record


def decomposed_paths(run: Run) -> tuple[Plan, list[str]]:
    """The plan and the ids of every decomposed path, in plan order."""
    plan, _, _ = run_plan(run)
    try:
        files = read_manifest(run.store, "paths")["files"]
    except NotFound:
        raise ConfigurationError(f"{run.url} is not decomposed yet: run `paths decompose {run.url} --levels G`") from None
    ids = sorted({name.split("/", 1)[0] for name in files if name.endswith("/path.json")})
    return plan, ids


def expert_names(run: Run) -> list[str]:
    """Names of the registered experts (committed ones only), from one listing."""
    return sorted({o.key.split("/")[1] for o in run.store.list("experts") if o.key.endswith("/manifest.json") and o.key.count("/") == 2})


def list_experts(run: Run) -> dict[str, dict[str, Any]]:
    """{name: expert.json} of every registered expert."""
    return {n: expert_info(run, n) for n in expert_names(run)}


def expert_info(run: Run, name: str) -> dict[str, Any]:
    """A registered expert's expert.json (checked against its manifest)."""
    try:
        return json.loads(read_verified(run.store, run.expert(name), "expert.json"))
    except NotFound:
        raise NotFound(f"no expert {name!r} in {run.url}: register it with `paths expert add {run.url} --name {name} --domain D ...`") from None


def is_expert(run: Run, unit: str) -> bool:
    """Whether a unit id names a registered expert (paths have ids like p03-11)."""
    return not PATH_ID.fullmatch(unit) and run.store.exists(f"{run.expert(unit)}/manifest.json")


def units(run: Run) -> list[str]:
    """Every claimable unit: the decomposed paths (if any), then the registered experts."""
    try:
        _, ids = decomposed_paths(run)
    except ConfigurationError:
        ids = []
    return [*ids, *expert_names(run)]


def step_budget(run: Run, unit: str) -> int | None:
    """An expert's own step budget (None for paths, and for experts registered without one)."""
    return expert_info(run, unit).get("steps") if is_expert(run, unit) else None


def data_id(run: Run, unit: str, manifest: dict[str, Any]) -> str:
    """Which shard of a dataset a unit trains on: its own, or (an expert) its domain's."""
    shards = manifest.get("paths", {})
    if unit in shards or not is_expert(run, unit):
        return unit
    domain = expert_info(run, unit)["domain"]
    if domain in shards:
        return domain
    raise NotFound(f"dataset {manifest.get('dataset', '?')!r} has no shard for expert {unit} or its domain {domain!r}: shard it with `paths shard ... --router domain --targets domains`")


def finished_paths(run: Run) -> list[str]:
    """Paths with a committed work/<path>/final/."""
    _, ids = decomposed_paths(run)
    return [p for p in ids if run.store.exists(f"{run.final(p)}/manifest.json")]


def composed_names(run: Run) -> list[str]:
    """Names of the committed composed models (composed/<name>/manifest.json), from one listing."""
    return sorted({o.key.split("/")[1] for o in run.store.list("composed") if o.key.endswith("/manifest.json") and o.key.count("/") == 2})


def default_eval_models(run: Run) -> list[str]:
    """What `paths eval` scores when no --model is given: the base and every composed model."""
    return ["base", *(f"composed:{n}" for n in composed_names(run))]


def claimable(run: Run, only: str | None = None) -> list[str]:
    """The units a worker may claim: every unit of the run, or just `only` (which must be one)."""
    ids = units(run)
    if not ids:
        raise ConfigurationError(f"{run.url} has nothing to claim: decompose it (`paths decompose`) or register experts (`paths expert add`)")
    if only is not None:
        if only not in ids:
            raise ConfigurationError(f"--path {only} is neither a decomposed path nor a registered expert of {run.url}: see `paths status {run.url}`")
        return [only]
    return ids
