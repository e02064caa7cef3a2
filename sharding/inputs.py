"""Raw inputs: fsspec URLs and globs of JSONL (plain, .gz, .zst), Parquet or text files, as records.

A record is one document (or, for `--kind prompts`, one prompt with its answer and the row's other
fields, which the rewards receive). Text files are
one document each (the whole file, its URL as id), the way code corpora are usually cut. Records
come out in a fixed order: inputs sorted by URL, then file order, so the same inputs always give
the same documents in the same order.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import fsspec

from paths.errors import ConfigurationError, DataError, NotFound

Format = Literal["auto", "jsonl", "parquet", "text"]
OnError = Literal["fail", "skip"]
_JSONL = (".jsonl", ".json", ".ndjson")
_COMPRESSED = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}


@dataclass(slots=True)
class Record:
    """One document: its text, a stable id, and the fields routers and prompts need."""

    text: str
    id: str
    domain: str | None = None
    answer: str | None = None
    extra: str | None = None  # Fields.rest: the row's other fields as one compact JSON object
    messages: list[dict[str, Any]] | None = None  # a chat prompt: rendered with the chat template when tokenized
    heldout: bool | None = None  # an environment's eval split: held out whatever the hash says
    answer_messages: list[dict[str, Any]] | None = None  # a chat completion: rendered after the prompt, as the answer text


@dataclass(slots=True)
class ReadStats:
    """What reading skipped, by reason."""

    records: int = 0
    empty: int = 0
    malformed: int = 0
    not_utf8: int = 0
    missing_field: int = 0
    no_expert: int = 0  # --targets domains: a domain no registered expert trains on
    problems: list[str] = field(default_factory=list)  # the first few skipped, for the report

    def skip(self, kind: str, where: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.problems) < 5:
            self.problems.append(where)

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("records", "empty", "malformed", "not_utf8", "missing_field", "no_expert")}


@dataclass(frozen=True, slots=True)
class Fields:
    """Which record fields hold what."""

    text: str = "text"
    id: str | None = None
    domain: str | None = None
    answer: str | None = None
    rest: bool = False  # keep every other field of a row (prompts: the rewards get them)


def expand(patterns: list[str], storage_options: dict[str, Any] | None = None) -> list[str]:
    """Every file the URLs and globs name, sorted and without duplicates; a pattern that matches
    nothing is an error that names it."""
    if not patterns:
        raise ConfigurationError("no --input given: pass one or more files, globs or URLs, e.g. --input 'data/*.jsonl'")
    from paths.envs.spec import is_env, parse

    found: set[str] = set()
    for pattern in patterns:
        if is_env(pattern):  # an environment is its own input: its rows are generated, not read
            found.add(parse(pattern).text)
            continue
        fs, _, paths = fsspec.get_fs_token_paths(pattern, storage_options=storage_options or {})
        files = [p for p in paths if not fs.isdir(p)]
        if not files:
            raise NotFound(f"--input {pattern} matches no file: give existing JSONL, Parquet or text files, a quoted glob ('data/*.jsonl') or a URL (s3://bucket/data/*.jsonl)")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        found.update(p if protocol in ("file", "local") else f"{protocol}://{p}" for p in files)
    return sorted(found)


def detect_format(url: str, fmt: Format) -> tuple[str, str | None]:
    """(jsonl | parquet | text, compression) of a file from its name unless given."""
    name = url.rsplit("/", 1)[-1].lower()
    compression = next((c for ext, c in _COMPRESSED.items() if name.endswith(ext)), None)
    if compression:
        name = name.rsplit(".", 1)[0]
    if fmt != "auto":
        return fmt, compression
    if name.endswith(_JSONL):
        return "jsonl", compression
    if name.endswith(".parquet"):
        return "parquet", compression
    return "text", compression


def read_records(
    url: str,
    fmt: Format,
    fields: Fields,
    on_error: OnError,
    stats: ReadStats,
    storage_options: dict[str, Any] | None = None,
) -> Iterator[Record]:
    """The usable records of one file; bad ones raise DataError naming file and line, or are
    skipped and counted with `on_error='skip'`. Empty documents are always skipped and counted."""
    from paths.envs.spec import is_env

    kind, compression = detect_format(url, fmt)
    opener = fsspec.open(url, "rb", compression=compression, **(storage_options or {}))
    if is_env(url):
        from paths.envs.sources import env_rows

        rows = env_rows(url)
    elif kind == "jsonl":
        rows = _jsonl_rows(url, opener, on_error, stats)
    elif kind == "parquet":
        rows = _parquet_rows(url, opener, fields)
    else:
        rows = _text_rows(url, opener, on_error, stats)
    for where, row in rows:
        record = _to_record(where, row, fields, on_error, stats)
        if record is None:
            continue
        if not record.text.strip():
            stats.skip("empty", where)
            continue
        stats.records += 1
        yield record


def _bad(kind: str, message: str, on_error: OnError, stats: ReadStats, where: str) -> None:
    if on_error == "fail":
        raise DataError(f"{message}: fix the input or pass --on-error skip")
    stats.skip(kind, where)


def _jsonl_rows(url: str, opener: Any, on_error: OnError, stats: ReadStats) -> Iterator[tuple[str, Any]]:
    with opener as f:
        lines = f if hasattr(f, "readline") and not _is_zstd(f) else io.BufferedReader(f)
        for n, raw in enumerate(lines, 1):
            where = f"{url}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                _bad("not_utf8", f"{where} is not UTF-8 (byte {exc.start} of the line)", on_error, stats, where)
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                _bad("malformed", f"{where} is not valid JSON ({exc.msg} at column {exc.colno})", on_error, stats, where)
                continue
            if not isinstance(row, dict):
                _bad("malformed", f"{where} is JSON but not an object", on_error, stats, where)
                continue
            yield where, row


def _is_zstd(f: Any) -> bool:
    return type(f).__module__.startswith("zstandard")  # its reader cannot iterate lines


def _parquet_rows(url: str, opener: Any, fields: Fields) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    wanted = [c for c in (fields.text, fields.id, fields.domain, fields.answer) if c]  # all columns with fields.rest
    with opener as f:
        try:
            pf = pq.ParquetFile(io.BytesIO(f.read()))
        except Exception as exc:  # pyarrow raises its own ArrowInvalid family
            raise DataError(f"{url} is not a readable Parquet file ({exc}): check the file or --format") from None
        names = pf.schema_arrow.names
        missing = [c for c in wanted if c not in names]
        if missing:
            raise DataError(f"{url} has no column {missing[0]!r} (columns: {', '.join(names[:10])}): pass the right --*-field")
        n = 0
        for batch in pf.iter_batches(columns=None if fields.rest else wanted, batch_size=4096):
            for row in batch.to_pylist():
                n += 1
                yield f"{url}:row {n}", row


def _text_rows(url: str, opener: Any, on_error: OnError, stats: ReadStats) -> Iterator[tuple[str, Any]]:
    with opener as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        _bad("not_utf8", f"{url} is not UTF-8 (byte {exc.start})", on_error, stats, url)
        return
    yield url, {"text": text, "id": url, "_text_file": True}


def _to_record(where: str, row: dict, fields: Fields, on_error: OnError, stats: ReadStats) -> Record | None:
    env = "_split" in row  # an environment's row: its fields have fixed names
    text_field = "text" if row.get("_text_file") else "prompt" if env else fields.text
    text = row.get(text_field)
    messages = None
    if isinstance(text, list) and fields.rest:  # a chat prompt: a list of messages
        from paths.envs.chat import check_messages

        messages = check_messages(text, f"{where} field {text_field!r}")
        text = "\n".join(str(m.get("content") or "") for m in messages)  # routers and ids see the words; the tokens come from the template
    if not isinstance(text, str):
        what = "has no" if text is None else "has a non-string"
        keys = ", ".join(list(row)[:8])
        _bad("missing_field", f"{where} {what} text field {text_field!r} (fields: {keys}); pass --text-field", on_error, stats, where)
        return None
    doc_id = str(row[fields.id]) if fields.id and row.get(fields.id) is not None else (row.get("id") if row.get("_text_file") or env else None)
    extra: dict[str, str | None] = {}
    answer_messages = None
    for kind, name in (("domain", fields.domain), ("answer", "answer" if env else fields.answer)):
        value = row.get(name) if name else None
        if kind == "answer" and isinstance(value, list) and messages is not None:  # a chat completion (TRL's conversational SFT form)
            from paths.envs.chat import check_messages

            answer_messages, value = check_messages(value, f"{where} field {name!r}"), ""
        if name and value is None:
            _bad("missing_field", f"{where} has no {kind} field {name!r}; pass --{kind}-field", on_error, stats, where)
            return None
        extra[kind] = None if value is None else str(value)
    rest = None
    if fields.rest and not row.get("_text_file"):
        kept = {k: v for k, v in row.items() if k not in (text_field, "answer" if env else fields.answer, "_split")}
        if messages is not None:
            kept["messages"] = messages  # what chat rewards (verifiers rubrics) see as the prompt
        if doc_id is not None and fields.id:
            kept["id"] = doc_id  # the --id-field value, as the dataset's id
        rest = json.dumps(kept, ensure_ascii=False, separators=(",", ":"), default=_as_text) if kept else None
    heldout = None if "_split" not in row else row["_split"] == "heldout"
    return Record(text=text, id=doc_id or "", extra=rest, messages=messages, heldout=heldout, answer_messages=answer_messages, **extra)


def _as_text(value: Any) -> str:
    """A value JSON has no type for (a Parquet timestamp, a decimal, bytes), as text for the rewards."""
    return value.isoformat() if hasattr(value, "isoformat") else str(value)
