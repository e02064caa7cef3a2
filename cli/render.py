"""Presentation only: turn library results into terminal tables or JSON text."""

from __future__ import annotations

import json
import time
from functools import singledispatch
from typing import Any, Sequence

from storage.admin import GcItem, Usage, VerifyReport
from storage.store import ObjectInfo


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table; numbers right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_num(r[i]) for r in rows) and rows for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def as_json(obj: Any) -> str:
    """Stable, indented JSON."""
    return json.dumps(obj, indent=2, sort_keys=True, default=str)


@singledispatch
def render(result: Any) -> str:
    """Default: JSON."""
    return as_json(result)


@render.register
def _(objects: list) -> str:
    if objects and all(isinstance(o, ObjectInfo) for o in objects):
        rows = [(o.size, _when(o.mtime), o.key) for o in objects]
        return table(("bytes", "modified", "key"), rows) + f"\n{len(objects)} objects, {human_bytes(sum(o.size for o in objects))}"
    if objects and all(isinstance(o, GcItem) for o in objects):
        rows = [(o.objects, human_bytes(o.bytes), o.key, o.reason) for o in objects]
        return table(("objects", "size", "key", "why"), rows)
    if not objects:
        return "(nothing)"
    return as_json(objects)


@render.register
def _(usage: Usage) -> str:
    rows = [(a, n, b, human_bytes(b)) for a, (b, n) in sorted(usage.areas.items())]
    rows.append(("total", usage.total_objects, usage.total_bytes, human_bytes(usage.total_bytes)))
    out = table(("area", "objects", "bytes", "size"), rows)
    if usage.paths:
        prows = [(p, n, b, human_bytes(b)) for p, (b, n) in sorted(usage.paths.items())]
        out += "\n\n" + table(("path", "objects", "bytes", "size"), prows)
    return out


@render.register
def _(report: VerifyReport) -> str:
    head = f"{report.manifests} manifests, {report.files} files checked: "
    if report.ok:
        return head + "all checksums match"
    rows = [(p.kind, p.key, p.detail) for p in report.problems]
    return head + f"{len(report.problems)} problems\n" + table(("problem", "key", "detail"), rows)


def render_claims(records: list[dict[str, Any]]) -> str:
    """Lease records as a table."""
    if not records:
        return "no claims"
    rows = [
        (
            r.get("path", "?"),
            r.get("state", "?"),
            r.get("worker", ""),
            r.get("generation", ""),
            _when(r.get("expires_at")),
            "yes" if r.get("expired") else "",
        )
        for r in records
    ]
    return table(("path", "state", "worker", "generation", "expires", "expired"), rows)


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def render_plan(s: dict[str, Any]) -> str:
    """The plan table of `paths plan` / `paths init --dry-run`."""
    rows = [
        (f"level {g}", f"layers {a}-{b}", n)
        for g, ((a, b), n) in enumerate(zip(s["level_layers"], s["layers_per_level"]))
    ]
    out = table(("level", "layers", "count"), rows)
    note = "" if s["decomposed"] else " (not decomposed yet)"
    return (
        f"{s['family']} MoE, {s['experts_per_layer']} experts per layer, {s['levels']} levels{note}\n{out}\n"
        f"paths: {s['paths']} (e.g. {s['example_path']})\n"
        f"parameters per path: {s['parameters_per_path']:,} ({s['parameters_shared']:,} shared)\n"
        f"parameters of the MoE: {s['parameters_total']:,}"
        + (_render_memory(s) if "memory" in s else "")
    )


def _render_memory(s: dict[str, Any]) -> str:
    rows = [(mode, f"{m['weights']:.1f}", f"{m['gradients']:.1f}", f"{m['optimizer']:.1f}", f"{m['activations']:.1f}", f"{m['total']:.1f}") for mode, m in s["memory"].items()]
    return (f"\npath form: {s['path_form']}\nmemory to train one path, GiB (micro-batch {s['micro_batch']} x {s['seq_len']} tokens; activations estimated, no recomputation):\n"
            + table(("mode", "weights", "gradients", "AdamW", "activations", "total"), rows)
            + ("" if "device_memory" not in s else f"\nwith {s['device_memory']:g} GiB: " + (f"{s['fits']} fits (the first, from a full fine-tune down)" if s["fits"] else
                                                   "no mode fits: a smaller --micro-batch or --seq-len, a lower --lora-rank, or a plan with more levels (smaller paths)")))


def render_dataset(manifest: dict[str, Any], json_out: bool = False) -> str:
    """Documents and tokens per path of a dataset manifest."""
    paths = manifest["paths"]
    summary = {
        "dataset": manifest["dataset"], "kind": manifest["data_kind"], "router": manifest["router"],
        "documents": manifest["documents"], "tokens": manifest["tokens"], "capacity": manifest.get("capacity"),
        "inputs": len(manifest["inputs"]), "skipped": _skipped(manifest["inputs"]), "paths": paths,
    }
    if json_out:
        return as_json(summary)
    rows = [[p, c["train_docs"], c["train_tokens"], c["heldout_docs"], c["heldout_tokens"]] for p, c in sorted(paths.items()) if c["train_docs"] + c["heldout_docs"]]
    head = (
        f"dataset {manifest['dataset']} ({manifest['data_kind']}): {manifest['documents']:,} documents, "
        f"{manifest['tokens']:,} tokens from {len(manifest['inputs'])} inputs; router {manifest['router']['kind']}"
        + (f", balanced (capacity {manifest['capacity']})" if manifest.get("capacity") else "")
    )
    skipped = summary["skipped"]
    tail = "skipped: " + ", ".join(f"{k} {v}" for k, v in skipped.items() if v) if any(skipped.values()) else "skipped: none"
    empty = len(paths) - len(rows)
    tail += f"; {empty} paths got no documents" if empty else ""
    return "\n".join([head, table(["path", "docs", "tokens", "heldout docs", "heldout tokens"], rows), tail])


def _skipped(inputs: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in inputs:
        for k, v in item["skipped"].items():
            if k != "records":
                out[k] = out.get(k, 0) + v
    return out


def render_status(rows: list[dict[str, Any]]) -> str:
    """`paths status` as a table and a one-line count per state."""
    def cell(v: Any, fmt: str = "{}") -> str:
        return "" if v is None else fmt.format(v)

    body = table(
        ("path", "state", "worker", "gen", "lease left", "committed", "step", "tokens", "loss", "final"),
        [(r["path"], r["state"], cell(r["worker"]), cell(r["generation"]), cell(r["lease_left_s"], "{:.0f}s"), cell(r["committed_step"]),
          cell(r["step"]), cell(r["tokens"]), cell(r["loss"], "{:.4f}"), "yes" if r["final"] else "") for r in rows],
    )
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    return body + "\n" + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))


def render_eval(result: dict[str, Any]) -> str:
    """Models x path shards (+ overall) of one `paths eval`."""
    cols = result["shards"] + ["overall"]
    rows = [[model] + [f"{row[c]:.3f}" for c in cols] for model, row in result["table"].items()]
    cols = [result.get("labels", {}).get(c, c) for c in cols]  # domain:path where the data was routed by domain
    head = f"{result['metric']} on {result['dataset']} ({result['split']}; lower is better)" if result["metric"] == "perplexity" else f"{result['metric']} on {result['dataset']} ({result['split']})"
    out = head + "\n" + table(["model"] + cols, rows)
    if tasks := result.get("tasks"):  # per task: mean reward (and pass@k)
        k = result.get("samples", 1)
        names = sorted({t for per in tasks.values() for t in per})
        heads = [f"{t} reward" for t in names] + ([f"{t} pass@{k}" for t in names] if k > 1 else [])
        rows = [[model] + [f"{per[t]['reward']:.3f}" if t in per else "-" for t in names] + ([f"{per[t][f'pass@{k}']:.3f}" if t in per else "-" for t in names] if k > 1 else [])
                for model, per in tasks.items()]
        out += "\nper task (greedy reward" + (f"; pass@{k} at temperature 1, threshold {result['pass_threshold']}" if k > 1 else "") + ")\n" + table(["model"] + heads, rows)
    return out


def render_compose_plan(plan: dict[str, Any]) -> str:
    """`paths compose --dry-run`: the output, the inputs, the options and the files to be written."""
    lines = [
        f"would write {plan['output']} ({'replacing the existing one once the new one is complete' if plan['replaces_existing'] else 'new'})",
        f"paths:     {', '.join(plan['paths'])}",
    ]
    if plan["excluded"]:
        lines.append(f"opted out: {', '.join(plan['excluded'])}; experts removed per layer: {plan['removed_experts']}")
    lines.append("options:   " + ", ".join(f"{k} {v}" for k, v in plan["options"].items() if v is not None))
    t = plan["tensors"]
    lines.append(f"tensors:   {t['total']} ({t['merged']} merged from the paths, {t['unchanged']} the base's bytes)")
    rows = [[name, f["tensors"], human_bytes(f["bytes"])] for name, f in plan["files"].items()]
    return "\n".join(lines) + "\n" + table(["file", "tensors", "bytes"], rows)
