"""`paths route`: put new documents where training put theirs, with a saved router."""

from __future__ import annotations

import json
from typing import IO, Any, Iterator

from sharding.inputs import Fields, Format, OnError, ReadStats, expand, read_records
from sharding.routers import load_router
from storage.layout import Run


def route(
    run: Run,
    router_name: str,
    inputs: list[str],
    out: IO[str],
    *,
    fmt: Format = "auto",
    fields: Fields = Fields(),
    on_error: OnError = "fail",
    top: int = 1,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, int]:
    """Write one JSON line per document: its id, path, and the `top` ranked paths with scores."""
    from paths.models import run_tokenizer
    from sharding.balance import top_k
    from sharding.shard import _encode

    router = load_router(run, router_name)
    tokenizer, _ = run_tokenizer(run)
    counts: dict[str, int] = {}
    stats = ReadStats()
    for batch in _batches(inputs, fmt, fields, on_error, stats, storage_options):
        docs = _encode(batch, tokenizer, "documents")
        prefs, scores = top_k(router.scores(docs, run), max(1, top))
        for doc, p, s in zip(docs, prefs, scores):
            line: dict[str, Any] = {"id": doc.record.id, "path": router.paths[p[0]]}
            if top > 1:
                line["ranked"] = [[router.paths[i], float(v)] for i, v in zip(p, s)]
            out.write(json.dumps(line) + "\n")
            counts[line["path"]] = counts.get(line["path"], 0) + 1
    return counts


def _batches(inputs: list[str], fmt: str, fields: Any, on_error: str, stats: dict[str, Any], storage_options: dict[str, Any] | None, size: int = 1024) -> Iterator[list]:
    batch = []
    for url in expand(inputs, storage_options):
        for record in read_records(url, fmt, fields, on_error, stats, storage_options):
            batch.append(record)
            if len(batch) == size:
                yield batch
                batch = []
    if batch:
        yield batch
