"""`paths shard`: read inputs, tokenize, route per document, write per-path zarr groups.

Three steps, each safe to kill:
1. **fit** the router (on a sample of documents, or a scan of the domain field) and save it to
   `router/<name>/` — once; a re-run loads it, so routing never changes under a resumed job.
2. **stage** every input file: its documents' tokens, ranked path preferences and held-out flags
   go to one object `data/<dataset>/_staging/part-<i>.safetensors` (single atomic write). A re-run
   skips the parts that exist: that is the resume after a kill.
3. **consolidate**: assign documents to paths (balanced or not) over all parts, write each path's
   zarr group in input order, upload it, then write `data/<dataset>/manifest.json` last and drop
   the staging parts. Same inputs and options give byte-identical arrays.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

import numpy as np

from paths.errors import ConfigurationError, DataError
from sharding import balance
from sharding.inputs import Fields, Format, OnError, ReadStats, Record, expand, read_records
from sharding.routers import Doc, Router, load_router, make_router, save_router, stable_hash
from sharding.writer import FIELDS_DOCUMENTS, FIELDS_PROMPTS, MemoryBudget, PathBuffer, group_checksum, write_groups
from storage.layout import Run
from storage.manifest import ArtifactWriter, read_manifest
from storage.safetensors_io import read_header

if TYPE_CHECKING:
    from paths.plan import Plan

FORMAT_VERSION = 1
PROMPTS_FORMAT_VERSION = 2  # 2: prompt datasets keep each record's other fields (fields_utf8)
STAGING = "_staging"
TOP_K = 8
MEMORY_BUDGET = 1 << 30  # bytes of path data held in memory before spilling to local files
Kind = Literal["documents", "prompts"]
Progress = Callable[[str, int], None]  # (event, amount): "docs" read, "file" staged, "path" written


@dataclass(kw_only=True, slots=True)
class ShardOptions:
    """Everything that decides a dataset's bytes (workers and progress do not)."""

    dataset: str
    inputs: list[str]
    format: Format = "auto"
    text_field: str = "text"
    id_field: str | None = None
    domain_field: str | None = None
    answer_field: str | None = None
    kind: Kind = "documents"
    router: str = "hash"
    targets: Literal["paths", "domains"] = "paths"  # domains: one shard per registered expert domain
    router_name: str | None = None
    domain_map: str | None = None
    features_model: str | None = None
    prefix_tokens: int = 32
    fit_sample: int = 2048
    balance: bool | None = None  # None: on for hash/moe/kmeans, off for domain
    slack: float = 0.1
    holdout: float = 0.01
    limit: int | None = None
    on_error: OnError = "fail"
    seed: int = 0
    system_prompt: str | None = None  # prompts: a system message first (plain-text prompts become chat prompts)
    chat_template: str | None = None  # prompts: a Jinja chat template instead of the tokenizer's
    chunk_tokens: int = 1 << 20
    shard_tokens: int = 16 << 20

    def __post_init__(self) -> None:
        from sharding.routers import ROUTERS
        from storage.layout import validate_name

        validate_name("dataset", self.dataset)
        if self.router not in ROUTERS:
            raise ConfigurationError(f"unknown router {self.router!r}: choose one of {', '.join(ROUTERS)}")
        if self.router == "domain" and not self.domain_field:
            raise ConfigurationError("the domain router needs --domain-field (the record field that names the domain)")
        if self.targets not in ("paths", "domains"):
            raise ConfigurationError(f"--targets must be paths or domains, got {self.targets!r}")
        if self.targets == "domains" and self.router != "domain":
            raise ConfigurationError("--targets domains shards one group per expert domain: use it with --router domain")
        if self.router == "domain" and self.balance:
            raise ConfigurationError("--balance would move documents out of their domain's path: drop it with the domain router")
        if self.kind == "prompts" and not self.answer_field:
            self.answer_field = "answer"
        if not 0 <= self.holdout < 1:
            raise ConfigurationError(f"--holdout must be in [0, 1), got {self.holdout}")
        if self.prefix_tokens < 1:
            raise ConfigurationError(f"--prefix-tokens must be >= 1, got {self.prefix_tokens}")
        if self.limit is not None and self.limit < 1:
            raise ConfigurationError(f"--limit must be >= 1, got {self.limit}")
        if self.chunk_tokens < 1 or self.shard_tokens % self.chunk_tokens:
            raise ConfigurationError("shard_tokens must be a positive multiple of chunk_tokens")

    @property
    def balanced(self) -> bool:
        return self.router != "domain" if self.balance is None else self.balance

    @property
    def fields(self) -> Fields:
        return Fields(self.text_field, self.id_field, self.domain_field, self.answer_field, rest=self.kind == "prompts")

    @property
    def format_version(self) -> int:
        return PROMPTS_FORMAT_VERSION if self.kind == "prompts" else FORMAT_VERSION

    @property
    def router_id(self) -> str:
        return self.router_name or self.dataset

    def router_options(self, domain_map: dict[str, str] | None) -> dict[str, Any]:
        return {"prefix_tokens": self.prefix_tokens, "features_model": self.features_model, "seed": self.seed, "domain_map": domain_map}


def shard(run: Run, opts: ShardOptions, *, overwrite: bool = False, workers: int = 1, storage_options: dict | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Shard the inputs into data/<dataset>/; returns the manifest."""
    from paths.models import run_tokenizer
    from paths.units import decomposed_paths

    progress = progress or (lambda event, n: None)
    if opts.targets == "domains":  # the domain experts' data: one shard per registered domain
        from paths.units import list_experts

        domains = sorted({e["domain"] for e in list_experts(run).values()})
        if not domains:
            raise ConfigurationError(f"--targets domains: {run.url} has no registered experts; add them with `paths expert add {run.url} --name NAME --domain D ...`")
        plan, path_ids = None, domains
    else:
        plan, path_ids = decomposed_paths(run)
    files = expand(opts.inputs, storage_options)
    _check_environments(files)
    tokenizer, tok_hash = run_tokenizer(run)
    fingerprint = _fingerprint(opts, files, tok_hash, plan.to_json() if plan else None, path_ids, storage_options)
    done = _existing(run, opts.dataset, fingerprint, overwrite)
    if done is not None:
        return done
    run.store.write(f"{run.dataset(opts.dataset)}/{STAGING}/options.json", _dumps(fingerprint))
    router = _router(run, opts, plan, path_ids, files, tokenizer, storage_options, overwrite)
    staged = _stage_all(run, opts, router, files, tokenizer, fingerprint["id"], workers, storage_options, progress)
    return _consolidate(run, opts, router, staged, fingerprint, path_ids, progress)


def _check_environments(files: list[str]) -> None:
    from paths.envs.spec import is_env

    if envs := [f for f in files if is_env(f)]:
        from paths.envs.sources import check_env

        for text in envs:
            check_env(text)


# -- options and what exists ---------------------------------------------------------------------
def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, indent=2, sort_keys=True).encode() + b"\n"


def _fingerprint(opts: ShardOptions, files: list[str], tok_hash: str, plan: dict, path_ids: list[str], storage_options: dict | None) -> dict[str, Any]:
    import fsspec

    from paths.envs.spec import is_env, parse

    entries = []
    for url in files:
        if is_env(url):  # an environment: what makes its rows is the package version, not a file size
            entries.append({"url": url, "bytes": 0, "environment": parse(url).provenance()})
            continue
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        entries.append({"url": url, "bytes": int(fs.size(path))})
    body = {
        "format_version": opts.format_version,
        "options": dataclasses.asdict(opts) | {"inputs": sorted(opts.inputs)},
        "files": entries,
        "tokenizer": tok_hash,
        "plan": plan,
        "paths": path_ids,
    }
    return {**body, "id": hashlib.sha256(_dumps(body)).hexdigest()}


def _existing(run: Run, dataset: str, fingerprint: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """The committed manifest when it matches (nothing to do); refuse or clear a different one."""
    prefix = run.dataset(dataset)
    found = None
    if run.store.exists(f"{prefix}/manifest.json"):
        found = read_manifest(run.store, prefix).get("fingerprint", {})
    elif run.store.exists(f"{prefix}/{STAGING}/options.json"):
        if not any(o.key.endswith(".safetensors") for o in run.store.list(f"{prefix}/{STAGING}")):
            return None  # an earlier attempt that staged nothing: start afresh
        found = json.loads(run.store.read(f"{prefix}/{STAGING}/options.json"))
    if found is None:
        return None
    if found.get("id") == fingerprint["id"] and not overwrite:
        return read_manifest(run.store, prefix) if run.store.exists(f"{prefix}/manifest.json") else None
    if not overwrite:
        diff = _differences(found, fingerprint)
        raise ConfigurationError(
            f"dataset {dataset!r} already exists in {run.url} with other {diff}: pass --overwrite to replace it, or use another --dataset"
        )
    run.store.delete_prefix(prefix)
    return None


def _differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    opts_old, opts_new = old.get("options", {}), new.get("options", {})
    keys = sorted(k for k in set(opts_old) | set(opts_new) if opts_old.get(k) != opts_new.get(k))
    if keys:
        return "options (" + ", ".join(f"{k}: {opts_old.get(k)!r} -> {opts_new.get(k)!r}" for k in keys[:3]) + ")"
    for k in ("files", "tokenizer", "plan", "paths"):
        if old.get(k) != new.get(k):
            return "input files" if k == "files" else k
    return "format"


# -- router --------------------------------------------------------------------------------------
def _router(run: Run, opts: ShardOptions, plan: Plan, path_ids: list[str], files: list[str], tokenizer: Any, storage_options: dict[str, Any] | None, overwrite: bool) -> Router:
    """Load the saved router, or fit and save a new one."""
    from sharding.routers import load_domain_map

    name = opts.router_id
    if run.store.exists(f"{run.router(name)}/manifest.json"):
        saved = load_router(run, name)
        provenance = json.loads(run.store.read(f"{run.router(name)}/router.json")).get("provenance", {})
        if saved.kind == opts.router and saved.paths == path_ids and provenance.get("fit") == _fit_key(opts):
            return saved
        if not (overwrite and provenance.get("dataset") == opts.dataset):
            raise ConfigurationError(
                f"router {name!r} already exists in {run.url} as a {saved.kind} router fitted otherwise: pass --router-name NEW, or --overwrite for a router this dataset made"
            )
        run.store.delete_prefix(run.router(name))
    domain_map = load_domain_map(opts.domain_map, path_ids, plan) if opts.domain_map else None
    router = make_router(opts.router, plan, path_ids, opts.router_options(domain_map))
    if router.needs_fit:
        if opts.router == "domain":  # every domain must be known: scan the field, no tokenizing
            sample = [Doc(r, []) for r in _records(opts, files, storage_options, None)]
        else:
            sample = _tokenized(_records(opts, files, storage_options, opts.fit_sample), tokenizer, opts)
        router.fit(sample, run)
    save_router(run, name, router, {"dataset": opts.dataset, "fit": _fit_key(opts), "at": time.time()})
    return router


def _fit_key(opts: ShardOptions) -> dict[str, Any]:
    keys = ("router", "domain_map", "domain_field", "features_model", "prefix_tokens", "fit_sample", "seed", "inputs", "text_field", "limit")
    return {k: getattr(opts, k) for k in keys}


def _records(opts: ShardOptions, files: list[str], storage_options: dict[str, Any] | None, limit: int | None):
    stats = ReadStats()
    n = 0
    for url in files:
        for record in read_records(url, opts.format, opts.fields, opts.on_error, stats, storage_options):
            if limit is not None and n >= limit:
                return
            n += 1
            yield record


def _render_chat(records: list[Record], tokenizer: Any, opts: ShardOptions) -> None:
    from paths.envs.chat import render, template_of, with_system

    for r in records:
        if r.messages is None and not opts.system_prompt:
            continue
        messages = with_system(r.messages or [{"role": "user", "content": r.text}], opts.system_prompt)
        template = template_of(tokenizer, opts.chat_template, f"dataset {opts.dataset!r}")
        tools = (json.loads(r.extra).get("tools") if r.extra else None) or None  # an environment's tools, described as the template does
        r.text = render(tokenizer, messages, template, tools)
        if r.answer_messages:  # the completion as the template writes it after the prompt, up to its last EOS (SFT adds that)
            whole = render(tokenizer, messages + r.answer_messages, template, tools, generation=False)
            if not whole.startswith(r.text):
                raise DataError(f"dataset {opts.dataset!r}: record {r.id or '?'}: the chat template renders the prompt differently once the completion follows: use an append-only template")
            completion = whole[len(r.text) :]
            eos = tokenizer.eos_token if isinstance(tokenizer.eos_token, str) else ""
            r.answer = completion[: completion.rfind(eos)] if eos and eos in completion else completion
        if r.messages is None or messages is not r.messages:  # the rewards see the messages the model was shown
            extra = json.loads(r.extra) if r.extra else {}
            r.extra = json.dumps({**extra, "messages": messages}, ensure_ascii=False, separators=(",", ":"))
        r.messages = messages


def _tokenized(records: list[dict[str, Any]], tokenizer: Any, opts: ShardOptions, batch: int = 1024) -> list[Doc]:
    out: list[Doc] = []
    chunk: list[Record] = []
    for record in records:
        chunk.append(record)
        if len(chunk) == batch:
            out += _encode(chunk, tokenizer, opts)
            chunk = []
    return out + (_encode(chunk, tokenizer, opts) if chunk else [])


def _encode(records: list[Record], tokenizer: Any, opts: ShardOptions | Kind) -> list[Doc]:
    """Batched fast tokenization; documents end in EOS, prompts do not (generation follows). Chat
    prompts (and, with a system prompt, every prompt) are rendered with the chat template first and
    the rendering becomes the record's text: what the model is shown."""
    kind = opts if isinstance(opts, str) else opts.kind
    if kind == "prompts" and not isinstance(opts, str):
        _render_chat(records, tokenizer, opts)
    ids = tokenizer([r.text for r in records], add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if kind == "documents" else []
    return [Doc(r, i + eos) for r, i in zip(records, ids)]


# -- staging ---------------------------------------------------------------------------------------
def _part_key(run: Run, dataset: str, index: int) -> str:
    return f"{run.dataset(dataset)}/{STAGING}/part-{index:05d}.safetensors"


def _stage_all(run: Run, opts: ShardOptions, router: Any, files: list[str], tokenizer: Any, fid: str, workers: int, storage_options: dict[str, Any] | None, progress: Any) -> list[str]:
    keys = [_part_key(run, opts.dataset, i) for i in range(len(files))]
    todo = [i for i, k in enumerate(keys) if not _part_ok(run, k, fid)]
    for i in range(len(files)):
        if i not in todo:
            progress("file", 1)
    if opts.limit is not None or workers <= 1:  # a limit needs the counts of earlier files: in order
        for i in todo:
            stage_file(run, opts, router, files, i, tokenizer, fid, storage_options, progress)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda i: stage_file(run, opts, router, files, i, tokenizer, fid, storage_options, progress), todo))
    return keys


def _part_ok(run: Run, key: str, fid: str) -> bool:
    return run.store.exists(key) and _part_meta(run, key)["fingerprint"] == fid


def _part_meta(run: Run, key: str) -> dict[str, str]:
    """A staged part's metadata, from its safetensors header alone."""
    return read_header(run.store, key)[1]


def stage_file(run: Run, opts: ShardOptions, router: Router, files: list[str], index: int, tokenizer: Any, fid: str, storage_options: dict[str, Any] | None, progress: Progress) -> None:
    """Read, tokenize and route one input file into its staging part (one atomic write)."""
    from safetensors.numpy import save

    t0 = time.time()
    cap = None
    if opts.limit is not None:
        before = sum(int(_part_meta(run, _part_key(run, opts.dataset, j))["docs"]) for j in range(index))
        cap = max(0, opts.limit - before)
    stats = ReadStats()
    docs: list[Doc] = []
    if cap != 0:
        records = read_records(files[index], opts.format, opts.fields, opts.on_error, stats, storage_options)
        batch: list[Record] = []
        for record in records:
            batch.append(record)
            if cap is not None and len(docs) + len(batch) >= cap:
                break
            if len(batch) == 1024:
                docs += _encode(batch, tokenizer, opts)
                progress("docs", len(batch))
                batch = []
        docs += _encode(batch, tokenizer, opts)
        progress("docs", len(batch))
    if opts.targets == "domains":  # documents of a domain no expert trains on are left out, and counted
        known = set(router.paths)
        for d in docs:
            if d.record.domain not in known:
                stats.skip("no_expert", f"{d.record.id or '?'} (domain {d.record.domain!r})")
        docs = [d for d in docs if d.record.domain in known]
    arrays = _part_arrays(docs, opts, router, run)
    meta = {
        "fingerprint": fid, "input": files[index], "docs": str(len(docs)),
        "stats": json.dumps(stats.to_json()), "seconds": f"{time.time() - t0:.3f}",
    }
    run.store.write(_part_key(run, opts.dataset, index), save(arrays, metadata=meta))
    progress("file", 1)


def _flat(chunks: list[list[int]], dtype: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Documents' values concatenated, and their lengths."""
    lengths = np.array([len(c) for c in chunks], dtype=np.int64)
    values = np.fromiter(itertools.chain.from_iterable(chunks), dtype=dtype, count=int(lengths.sum()))
    return values, lengths


def _flat_text(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """UTF-8 bytes of texts concatenated, and their byte lengths."""
    encoded = [t.encode() for t in texts]
    return np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(), np.array([len(e) for e in encoded], dtype=np.int64)


def _part_arrays(docs: list[Doc], opts: ShardOptions, router: Router, run: Run) -> dict[str, np.ndarray]:
    tokens, lengths = _flat([d.ids for d in docs], np.uint32)
    arrays = {"tokens": tokens, "tokens_len": lengths}
    if docs:
        scores = np.concatenate([router.scores(docs[i : i + 4096], run) for i in range(0, len(docs), 4096)])
    else:
        scores = np.zeros((0, len(router.paths)), np.float32)
    arrays["prefs"], arrays["pref_scores"] = balance.top_k(scores, TOP_K)
    arrays["heldout"] = np.array([d.record.heldout if d.record.heldout is not None else stable_hash("heldout\0" + d.key) / 2.0**64 < opts.holdout
                                  for d in docs], dtype=np.uint8)
    if opts.kind == "prompts":
        arrays["prompt"], arrays["prompt_len"] = _flat_text([d.record.text for d in docs])
        arrays["answer"], arrays["answer_len"] = _flat_text([d.record.answer or "" for d in docs])
        arrays["fields"], arrays["fields_len"] = _flat_text([d.record.extra or "" for d in docs])
    return arrays


# -- consolidation ---------------------------------------------------------------------------------
def _local_part(run: Run, key: str, folder: str, i: int) -> str:
    """A part as a local file: the object itself on a local run, else a download."""
    if (path := run.store.local_path(key)) is not None:
        return path
    local = os.path.join(folder, f"part-{i:05d}.safetensors")
    with open(local, "wb") as f:
        f.write(run.store.read(key))
    return local


def _consolidate(run: Run, opts: ShardOptions, router: Router, keys: list[str], fingerprint: dict, path_ids: list[str], progress: Progress) -> dict[str, Any]:
    from safetensors import safe_open
    from safetensors.numpy import load_file

    fields = FIELDS_PROMPTS if opts.kind == "prompts" else FIELDS_DOCUMENTS
    tmp = tempfile.mkdtemp(prefix="paths-shard-")
    try:
        locals_, prefs, scores, inputs = [], [], [], []
        for i, key in enumerate(keys):  # first pass: only the preferences, for the assignment
            local = _local_part(run, key, tmp, i)
            locals_.append(local)
            with safe_open(local, framework="numpy") as part:
                meta = part.metadata()
                prefs.append(part.get_tensor("prefs"))
                scores.append(part.get_tensor("pref_scores"))
                tokens = int(part.get_tensor("tokens_len").sum())
            inputs.append({"url": meta["input"], "docs": int(meta["docs"]), "tokens": tokens, "skipped": json.loads(meta["stats"]), "seconds": float(meta["seconds"])})
        all_prefs = np.concatenate(prefs) if prefs else np.zeros((0, 1), np.int32)
        all_scores = np.concatenate(scores) if scores else np.zeros((0, 1), np.float32)
        assignment = balance.assign(all_prefs, all_scores, len(path_ids), opts.slack if opts.balanced else None)
        budget = MemoryBudget(MEMORY_BUDGET)
        buffers = {p: PathBuffer(os.path.join(tmp, p), fields, budget) for p in path_ids}
        start = 0
        for local in locals_:
            part = load_file(local)
            n = len(part["tokens_len"])
            _scatter(part, assignment[start : start + n], buffers, path_ids, fields)
            start += n
        writer = ArtifactWriter(run.store, run.dataset(opts.dataset))
        jobs = []
        for p in path_ids:
            buffers[p].close()
            run.store.delete_prefix(run.shard(opts.dataset, p))  # what a killed attempt left
            jobs.append((run.shard(opts.dataset, p), buffers[p], {"dataset": opts.dataset, "path": p, "kind": opts.kind, "format_version": opts.format_version}))
        counts = {}
        for p, (count, files) in zip(path_ids, write_groups(run.store, jobs, opts.chunk_tokens, opts.shard_tokens)):
            counts[p] = count
            writer.files.update({f"{p}.zarr/{k}": e for k, e in sorted(files.items())})
        progress("path", len(path_ids))
        per_path = {p: {**counts[p], "checksum": group_checksum(writer.files, f"{p}.zarr/")} for p in path_ids}
        docs = sum(c["train_docs"] + c["heldout_docs"] for c in per_path.values())
        manifest = writer.commit(
            kind="dataset", format_version=opts.format_version, dataset=opts.dataset, data_kind=opts.kind,
            fingerprint=fingerprint, router={"name": opts.router_id, "kind": router.kind, "balanced": opts.balanced, "slack": opts.slack},
            tokenizer=fingerprint["tokenizer"], inputs=inputs, paths=per_path, documents=docs,
            tokens=sum(c["train_tokens"] + c["heldout_tokens"] for c in per_path.values()),
            capacity=balance.capacity(docs, len(path_ids), opts.slack) if opts.balanced and docs else None,
            environments=[f["environment"] for f in fingerprint["files"] if "environment" in f],
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    run.store.delete_prefix(f"{run.dataset(opts.dataset)}/{STAGING}")
    return manifest


def _scatter(part: dict[str, np.ndarray], paths_N: np.ndarray, buffers: dict[str, PathBuffer], path_ids: list[str], fields: tuple[str, ...]) -> None:
    """Append one part's documents to their paths' buffers, keeping document order."""
    heldout = part["heldout"].astype(bool)
    for name in fields:
        values, lengths = part[name], part[f"{name}_len"]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for p in np.unique(paths_N):
            for split, mask in (("train", ~heldout), ("heldout", heldout)):
                idx = np.flatnonzero((paths_N == p) & mask)
                if len(idx) == 0:
                    continue
                chunk = np.concatenate([values[offsets[i] : offsets[i + 1]] for i in idx])
                buffers[path_ids[p]].append(split, name, chunk, lengths[idx])
