"""`paths compose --into ensemble`: trained paths and domain experts as one model that stock
transformers loads with `trust_remote_code=True` (the modeling file ships inside the folder).

The folder: config.json (model_type `paths_ensemble`, auto_map, members, mix, prior),
modeling_paths_ensemble.py, the run's tokenizer, members/<name>/ (each member's trained HF
checkpoint, as `paths train` left it), for `--mix router` router/ (the saved sharding router and
the base model it reads), and compose.json; its manifest is written last.

The cached prior (ELMForest / DEMix): over `prior_docs` held-out documents taken in turn from each
shard of a dataset (a shard with fewer documents repeats its own), each document's posterior over members P(j | x) ~ P(x | j) P(j) (uniform P(j))
is folded into an exponential average, prior <- (1 - decay) prior + decay posterior, from uniform.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Literal

import torch

from paths.errors import ConfigurationError, NotFound
from storage.layout import Run
from storage.manifest import install, read_manifest, read_verified, sha256_hex

MODELING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "modeling_paths_ensemble.py")
Mix = Literal["posterior", "uniform", "router"]


def finished_units(run: Run) -> list[str]:
    """Registered experts with a final/, else paths with one."""
    from paths.units import finished_paths
    from paths.units import expert_names

    experts = [n for n in expert_names(run) if run.store.exists(f"{run.final(n)}/manifest.json")]
    if experts:
        return experts
    try:
        return finished_paths(run)
    except ConfigurationError:
        return []


def _fetch_member(run: Run, spec: str, out: str) -> tuple[str, dict[str, Any]]:
    """(member name, what it is) with the member's checkpoint in out/ (paths.models.resolve_model)."""
    from paths.models import parse_model, resolve_model

    ref = parse_model(spec if ":" in spec else f"path:{spec}", kinds=("path", "expert", "hf"), option="--members")
    if ref.kind == "hf":
        folder = resolve_model(run, ref, os.path.dirname(out), option="member").folder
        shutil.copytree(folder, out)
        return os.path.basename(os.path.normpath(folder)), {"source": os.path.abspath(folder)}
    try:
        manifest = read_manifest(run.store, run.final(ref.name))
    except NotFound:
        raise ConfigurationError(f"member {ref.name} has no final/ in {run.url}: train it first (`paths claim {run.url} --path {ref.name} && paths train ...`) or leave it out") from None
    folder = resolve_model(run, ref, os.path.dirname(out), option="member").folder
    if os.path.dirname(folder) == os.path.dirname(out):  # our own verified copy: moved, not copied again
        os.rename(folder, out)
    else:  # the shared cache of a remote run stays whole
        shutil.copytree(folder, out)
    return ref.name, {"final_checksum": sha256_hex(json.dumps(manifest["files"], sort_keys=True).encode())}


def _same_tokenizer(ours: Any, members: dict[str, str]) -> None:
    """Refuse members whose tokenizer differs from the run's (`ours`), naming them."""
    from transformers import AutoTokenizer

    vocab = ours.get_vocab()
    wrong = []
    for name, folder in members.items():
        if any(os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            if AutoTokenizer.from_pretrained(folder).get_vocab() != vocab:
                wrong.append(name)
        else:
            config = json.load(open(os.path.join(folder, "config.json")))
            if config.get("vocab_size", 0) < len(ours):
                wrong.append(name)
    if wrong:
        raise ConfigurationError(f"members {', '.join(wrong)} use another tokenizer than the run's ({len(ours)} tokens): an ensemble mixes next-token distributions, so every member must share it")


@torch.no_grad()
def cached_prior(members: dict[str, str], docs: list, decay: float, max_tokens: int = 256) -> list[float]:
    """Exponentially averaged document posteriors (uniform start and per-document prior)."""
    from transformers import AutoModelForCausalLM

    models = [AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval() for folder in members.values()]
    J = len(models)
    prior = torch.full((J,), 1.0 / J, dtype=torch.float64)
    for ids in docs:
        x = torch.from_numpy(ids[:max_tokens].astype("int64")).unsqueeze(0)
        if x.shape[1] < 2:
            continue
        ll = []
        for m in models:
            lp = torch.log_softmax(m(input_ids=x).logits.float(), dim=-1)
            ll.append(float(lp[0, :-1].gather(-1, x[0, 1:, None]).sum()))
        posterior = torch.softmax(torch.tensor(ll, dtype=torch.float64), dim=0)
        prior = (1 - decay) * prior + decay * posterior
    return [float(p) for p in prior / prior.sum()]


def _prior_documents(run: Run, dataset: str, n: int) -> list:
    """n held-out documents, taken in turn from each shard, a shard with fewer documents repeating
    its own (train split if none is held out): every shard is seen throughout the average."""
    from sharding.dataset import dataset_manifest, read_documents

    manifest = dataset_manifest(run, dataset)
    if manifest.get("data_kind") != "documents":
        raise ConfigurationError(f"--prior-data {dataset!r} holds prompts: give a documents dataset")
    split = "heldout" if any(c["heldout_docs"] for c in manifest["paths"].values()) else "train"
    per_shard = [read_documents(run, dataset, p, split) for p in sorted(manifest["paths"]) if manifest["paths"][p][f"{split}_docs"]]
    out, i = [], 0
    while len(out) < n:
        out.extend(d[i % len(d)] for d in per_shard)
        i += 1
    return out[:n]


def _router_spec(run: Run, router_name: str | None, names: list[str], folder: str) -> dict[str, Any]:
    """router/ of the ensemble (the saved router and the base model it reads) and config's entry."""
    from paths.units import run_plan
    from paths.families import fill
    from sharding.kmeans import split_dims
    from sharding.routers import load_router

    saved = sorted({o.key.split("/")[1] for o in run.store.list("router") if o.key.endswith("/manifest.json")})
    if router_name is None:
        if len(saved) != 1:
            raise ConfigurationError(f"--mix router needs a saved router: {run.url} has {len(saved)} ({', '.join(saved) or 'none'}); shard with --router moe or kmeans, then pass --router-name NAME")
        router_name = saved[0]
    router = load_router(run, router_name)
    if router.kind not in ("moe", "kmeans") or router.options.get("features_model"):
        raise ConfigurationError(f"--mix router: router {router_name!r} is {router.kind}{' over --features-model' if router.options.get('features_model') else ''}, which does not read the text with the base model; use a moe or kmeans router")
    plan, family, _ = run_plan(run)
    for n in names:
        if n not in router.paths:
            raise ConfigurationError(f"--mix router: member {n} is not a path the router {router_name!r} routes to; members must be paths of the plan")
    spec: dict[str, Any] = {"kind": router.kind, "name": router_name, "prefix_tokens": router.options["prefix_tokens"], "choices": [list(plan.parse(n)) for n in names]}
    os.makedirs(os.path.join(folder, "router", "model"))
    base_files = read_manifest(run.store, run.base)["files"]
    for fname in base_files:
        with open(os.path.join(folder, "router", "model", fname), "wb") as f:
            f.write(read_verified(run.store, run.base, fname))
    for fname in ("router.json", "router.safetensors"):
        with open(os.path.join(folder, "router", fname), "wb") as f:
            f.write(read_verified(run.store, run.router(router_name), fname))
    if router.kind == "kmeans":
        hidden = json.load(open(os.path.join(folder, "router", "model", "config.json")))["hidden_size"]
        spec["blocks"] = [list(b) for b in split_dims(hidden, plan.levels)]
    else:
        sparse = plan.sparse_layers
        spec["modules"] = [fill(family.router["memory"], layer).rsplit(".", 1)[0] for layer in sparse]
        spec["level_layers"] = [[sparse.index(layer) for layer in span if layer in sparse] for span in plan.level_layers]  # positions in modules
    return spec


def compose_ensemble(
    run: Run,
    name: str,
    *,
    members: list[str] | None = None,
    mix: Mix = "posterior",
    prior: Literal["cached", "uniform"] = "cached",
    prior_data: str | None = None,
    prior_docs: int = 100,
    prior_decay: float = 0.3,
    router_name: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write composed/<name>/ as an ensemble; returns its compose.json."""
    from paths.models import fetch_dir, run_tokenizer

    prefix = run.composed(name)
    if run.store.exists(f"{prefix}/manifest.json") and not overwrite:
        raise ConfigurationError(f"{run.store.url_of(prefix)} already exists: pass --overwrite or choose another --name")
    if mix not in ("posterior", "uniform", "router") or prior not in ("cached", "uniform"):
        raise ConfigurationError(f"--mix must be posterior, uniform or router and --prior cached or uniform; got {mix!r}, {prior!r}")
    if members is not None and not members:
        raise ConfigurationError("--members is empty: name at least one trained path or expert")
    specs = members if members is not None else finished_units(run)
    if not specs:
        raise ConfigurationError(f"no trained path or expert in {run.url} to ensemble: train some, or name them with --members")
    if len(set(specs)) != len(specs):
        raise ConfigurationError(f"--members names one member twice: {','.join(specs)}")
    if not 0 < prior_decay <= 1 or prior_docs < 1:
        raise ConfigurationError(f"--prior-decay must be in (0, 1] and --prior-docs >= 1, got {prior_decay} and {prior_docs}")
    use_cached = mix == "posterior" and prior == "cached" and len(specs) > 1
    if use_cached and not prior_data:
        raise ConfigurationError("--prior cached needs --prior-data DATASET (held-out documents to estimate it on), or use --prior uniform")

    t0 = time.perf_counter()
    tmp = run.store.scratch_dir("ensemble")
    try:
        folders, record_members = {}, {}
        for spec in specs:
            staging = os.path.join(tmp, "staging", str(len(folders)))
            mname, info = _fetch_member(run, spec, staging)
            if mname in folders:
                raise ConfigurationError(f"two members are named {mname}: give distinct folders")
            folders[mname] = staging
            config = json.load(open(os.path.join(staging, "config.json")))
            record_members[mname] = {**info, "spec": spec, "model_type": config.get("model_type"), "hidden_size": config.get("hidden_size"), "num_hidden_layers": config.get("num_hidden_layers"), "vocab_size": config.get("vocab_size")}
        tok, _ = run_tokenizer(run)
        _same_tokenizer(tok, folders)
        names = list(folders)
        out = os.path.join(tmp, "out")
        os.makedirs(os.path.join(out, "members"))
        for mname, staging in folders.items():
            shutil.move(staging, os.path.join(out, "members", mname))
        router = _router_spec(run, router_name, names, out) if mix == "router" else None
        prior_values = None
        if use_cached:
            docs = _prior_documents(run, prior_data, prior_docs)
            prior_values = cached_prior({n: os.path.join(out, "members", n) for n in names}, docs, prior_decay)
        tok_folder = fetch_dir(run, run.tokenizer)
        for fname in read_manifest(run.store, run.tokenizer)["files"]:
            shutil.copy(os.path.join(tok_folder, fname), os.path.join(out, fname))
        from compose.modeling_paths_ensemble import write_config

        vocab = min([len(tok), *(m["vocab_size"] or len(tok) for m in record_members.values())])
        contexts = [json.load(open(os.path.join(out, "members", n, "config.json"))).get("max_position_embeddings") for n in names]
        write_config(
            out, members=names, mix=mix, prior=prior_values, vocab_size=vocab, router=router,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            max_position_embeddings=min(c for c in contexts if c) if any(contexts) else None,  # what evaluators read as the context
        )
        shutil.copy(MODELING, os.path.join(out, "modeling_paths_ensemble.py"))
        record = {
            "name": name, "into": "ensemble", "members": record_members, "order": names,
            "options": {"mix": mix, "prior": prior if mix == "posterior" else None, "prior_data": prior_data, "prior_docs": prior_docs, "prior_decay": prior_decay, "router_name": router and router["name"]},
            "prior": prior_values, "seconds": round(time.perf_counter() - t0, 3), "at": time.time(),
        }
        for mname in names:  # a member's own manifest: the ensemble's covers its files
            member_manifest = os.path.join(out, "members", mname, "manifest.json")
            if os.path.exists(member_manifest):
                os.remove(member_manifest)
        install(run.store, out, prefix, overwrite, {"compose.json": record}, kind="composed", into="ensemble", name=name)
        return record
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
