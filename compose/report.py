"""`paths report`: one self-contained HTML page of a run, with its charts beside it as PNGs.

What it shows, each read from the run (local folder or S3) and nothing else:
- loss curves per unit (lm, sft, finetune-moe) and reward curves (grpo), from work/<unit>/metrics.jsonl,
  and for GRPO on a mixture each source's reward, length, truncation and share;
- documents and tokens per path from each dataset's manifest (the routing histogram);
- a timeline of the claims: which worker held which path when, takeovers marked (claims/*.json
  and the tenures each record keeps in its history);
- the eval tables in eval/, and the composed models with their provenance (compose.json).

The page embeds its charts (data: URIs), so it can be mailed or opened from a bucket as one file.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from paths.errors import ConfigurationError, PathsError
from storage.layout import Run

CHARTS = ("loss", "reward", "routing", "claims")


@dataclass
class Report:
    """What `write_report` wrote: the page, the charts beside it, and what the run lacks."""

    index: str
    images: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    trained: int = 0


class NothingTrained(PathsError):
    """The report was written, but the run has no trained unit yet."""


# -- what the run holds ---------------------------------------------------------------------------
def _json(run: Run, key: str) -> Any:
    try:
        return json.loads(run.store.read(key))
    except (ValueError, PathsError):
        return None


def _lines(run: Run, key: str) -> list[dict[str, Any]]:
    out = []
    for line in run.store.read(key).decode().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn last line of a log being written: the rest still counts
        if isinstance(record, dict) and "step" in record:
            out.append(record)
    return out


def gather(run: Run) -> dict[str, Any]:
    """Everything the report shows, as plain data (the run's numbers, unformatted)."""
    meta = run.read_meta()  # not a run: NotFound naming `paths storage init`
    units: dict[str, dict[str, Any]] = {}
    for o in run.store.list("work"):
        parts = o.key.split("/")
        if len(parts) == 3 and parts[2] == "metrics.jsonl":
            units.setdefault(parts[1], {})["metrics"] = _lines(run, o.key)
        elif len(parts) == 4 and parts[2] == "final" and parts[3] == "provenance.json":
            units.setdefault(parts[1], {})["provenance"] = _json(run, o.key)
    for name, unit in units.items():
        unit.setdefault("metrics", [])
        prov = unit.get("provenance") or {}
        records = unit["metrics"]
        unit["kind"] = "grpo" if any("reward_mean" in m for m in records) or prov.get("mode") == "grpo" else ("finetune-moe" if name.startswith("moe-") else prov.get("mode", "lm"))
    datasets = {}
    for o in run.store.list("data"):
        parts = o.key.split("/")
        if len(parts) == 3 and parts[2] == "manifest.json":
            manifest = _json(run, o.key)
            if isinstance(manifest, dict) and isinstance(manifest.get("paths"), dict):
                datasets[parts[1]] = {"kind": manifest.get("data_kind", "documents"), "router": (manifest.get("router") or {}).get("kind"),
                                      "paths": {p: {k: e.get(k, 0) for k in ("train_docs", "train_tokens", "heldout_docs", "heldout_tokens")} for p, e in manifest["paths"].items()}}
    claims = {}
    for o in run.store.list("claims"):
        parts = o.key.split("/")
        if len(parts) == 2 and parts[1].endswith(".json"):
            record = _json(run, o.key)
            if isinstance(record, dict) and "state" in record:
                claims[parts[1][:-5]] = record
    evals = []
    for o in run.store.list("eval"):
        if o.key.endswith(".json") and o.key.count("/") == 2:
            result = _json(run, o.key)
            if isinstance(result, dict) and isinstance(result.get("table"), dict):
                evals.append(result)
    composed = {}
    for o in run.store.list("composed"):
        parts = o.key.split("/")
        if len(parts) == 3 and parts[2] == "compose.json" and run.store.exists(f"composed/{parts[1]}/manifest.json"):
            composed[parts[1]] = _json(run, o.key) or {}
    return {"run": run.url, "meta": meta, "units": units, "datasets": datasets, "claims": claims, "evals": sorted(evals, key=lambda e: e.get("at", 0)), "composed": composed}


def timeline(claims: dict[str, dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """Every tenure of every path: {path, worker, generation, from, until, ended} — the history a
    record keeps, then its current holder (ended: done, failed, holding, expired, handed back)."""
    out = []
    for path, record in sorted(claims.items()):
        for t in record.get("history", []):
            if isinstance(t, dict) and t.get("from") is not None:
                out.append({"path": path, **t})
        if record.get("worker") and record.get("claimed_at") is not None:
            state = record.get("state")
            live = state == "claimed" and float(record.get("expires_at", 0)) >= now
            ended = "holding" if live else {"claimed": "expired", "open": "handed back"}.get(state, state)
            until = record.get("finished_at") or record.get("released_at") or (now if live else min(float(record.get("expires_at", now)), now))
            out.append({"path": path, "worker": record["worker"], "generation": record.get("generation"), "from": record["claimed_at"], "until": until, "ended": ended, "step": record.get("step")})
    return out


# -- charts ---------------------------------------------------------------------------------------
def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def png(fig) -> bytes:
    """A figure as PNG bytes (the figure is closed)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return buf.getvalue()


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


LINESTYLES = ("-", "--", ":", "-.")


def line_style(i: int) -> dict[str, Any]:
    """Unit i's colour and line style: tab20's 20 colours, then the same colours dashed, dotted and
    dash-dotted, so up to 80 units (more than any legend shows) never look the same."""
    k = i % 20  # tab20's even entries are tab10's colours, its odd ones their light variants
    return {"color": matplotlib_color("tab20", 2 * k if k < 10 else 2 * (k - 10) + 1), "linestyle": LINESTYLES[(i // 20) % len(LINESTYLES)]}


def matplotlib_color(cmap: str, k: int) -> tuple[float, ...]:
    import matplotlib

    return tuple(matplotlib.colormaps[cmap](k))


def _legend(ax, n: int) -> None:
    if n <= 32:
        ax.legend(fontsize=7, ncol=2 if n > 16 else 1, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def loss_chart(units: dict[str, dict[str, Any]]) -> bytes | None:
    """Loss per step, one line per unit, one panel per kind of training (lm, sft, finetune-moe)."""
    kinds = sorted({u["kind"] for u in units.values() if u["kind"] != "grpo" and any("loss" in m for m in u["metrics"])})
    if not kinds:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(len(kinds), 1, figsize=(9, 3.6 * len(kinds)), squeeze=False)
    for ax, kind in zip(axes[:, 0], kinds):
        shown = [(n, u) for n, u in sorted(units.items()) if u["kind"] == kind and u["metrics"]]
        for i, (name, unit) in enumerate(shown):
            steps = [m["step"] for m in unit["metrics"] if "loss" in m]
            ax.plot(steps, [m["loss"] for m in unit["metrics"] if "loss" in m], lw=1.2, label=name, **line_style(i))
        ax.set(title=f"{kind}: training loss ({len(shown)} units)", xlabel="optimizer step", ylabel="loss")
        ax.grid(alpha=0.3)
        _legend(ax, len(shown))
    fig.tight_layout()
    return png(fig)


def reward_chart(units: dict[str, dict[str, Any]]) -> bytes | None:
    """GRPO: the mean reward of each step's rollout (faint) and its moving average, per unit, with
    the held-out reward (greedy) as markers where it was measured."""
    shown = [(n, u) for n, u in sorted(units.items()) if u["kind"] == "grpo" and any("reward_mean" in m for m in u["metrics"])]
    if not shown:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for i, (name, unit) in enumerate(shown):
        style = line_style(i)
        color = style["color"]
        records = [m for m in unit["metrics"] if "reward_mean" in m]
        steps, rewards = [m["step"] for m in records], [m["reward_mean"] for m in records]
        ax.plot(steps, rewards, color=color, alpha=0.25, lw=0.8)
        ax.plot(steps, _smooth(rewards, max(1, len(rewards) // 10)), lw=1.6, label=f"{name} rollout reward", **style)
        held = [m for m in unit["metrics"] if "heldout_reward" in m]
        if held:
            ax.plot([m["step"] for m in held], [m["heldout_reward"] for m in held], "o--", color=color, ms=4, lw=0.8, label=f"{name} held-out")
    ax.set(title="GRPO reward per step", xlabel="optimizer step", ylabel="reward")
    ax.grid(alpha=0.3)
    _legend(ax, 2 * len(shown))
    return png(fig)


def routing_chart(datasets: dict[str, dict[str, Any]]) -> bytes | None:
    """Documents and tokens routed to each path, one row per dataset (train split)."""
    if not datasets:
        return None
    plt = pyplot()
    names = sorted(datasets)
    fig, axes = plt.subplots(len(names), 2, figsize=(12, 2.8 * len(names)), squeeze=False)
    for row, name in zip(axes, names):
        entries = datasets[name]["paths"]
        ids = sorted(entries)
        for ax, what, color in zip(row, ("train_docs", "train_tokens"), ("C0", "C2")):
            ax.bar(range(len(ids)), [entries[p][what] for p in ids], color=color)
            ax.set_xticks(range(len(ids)), ids, rotation=90 if len(ids) > 6 else 0, fontsize=7)
            ax.set(title=f"{name}: {what.replace('train_', '')} per path", ylabel=what.replace("train_", ""))
            ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return png(fig)


def claims_chart(tenures: list[dict[str, Any]]) -> bytes | None:
    """Who held which path when: one bar per tenure, coloured by worker; an expired lease that
    another worker took over is marked with a red x where it ended."""
    if not tenures:
        return None
    plt = pyplot()
    paths = sorted({t["path"] for t in tenures})
    workers = sorted({t["worker"] for t in tenures})
    t0 = min(float(t["from"]) for t in tenures)
    fig, ax = plt.subplots(figsize=(10, max(2.0, 0.32 * len(paths) + 1.2)))
    cmap = plt.get_cmap("tab20")
    for t in tenures:
        y = paths.index(t["path"])
        start, end = float(t["from"]) - t0, max(float(t["until"]), float(t["from"])) - t0
        ax.barh(y, max(end - start, 1e-3), left=start, height=0.6, color=cmap(workers.index(t["worker"]) % 20), edgecolor="black" if t["ended"] == "holding" else "none")
        if t["ended"] == "expired":
            ax.plot(end, y, "x", color="red", ms=9, mew=2)
    ax.set_yticks(range(len(paths)), paths, fontsize=7)
    ax.invert_yaxis()
    ax.set(title="claims: who held which path when (red x: lease expired, taken over)", xlabel=f"seconds since the first claim ({time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(t0))} UTC)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(i % 20)) for i in range(len(workers))]
    if len(workers) <= 20:
        ax.legend(handles, workers, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False, title="worker")
    ax.grid(axis="x", alpha=0.3)
    return png(fig)


# -- the page -------------------------------------------------------------------------------------
def fmt(x: Any) -> str:
    """How the page writes a number (4 significant digits) or anything else."""
    if isinstance(x, bool) or x is None:
        return "" if x is None else str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def html_table(headers: list[str], rows: list[list[Any]], cls: str = "") -> str:
    """An HTML table; numbers right-aligned and written by `fmt`."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td{' class=num' if isinstance(c, (int, float)) and not isinstance(c, bool) else ''}>{html.escape(fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table class='{cls}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _units_table(units: dict[str, dict[str, Any]], claims: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, unit in sorted(units.items()):
        last = unit["metrics"][-1] if unit["metrics"] else {}
        prov = unit.get("provenance") or {}
        reward = last.get("reward_mean")
        rows.append([name, unit["kind"], prov.get("dataset", ""), last.get("step", 0), last.get("tokens", 0), last.get("loss"), reward, (claims.get(name) or {}).get("state", ""), "yes" if prov else "no"])
    return html_table(["unit", "training", "dataset", "steps", "tokens", "last loss", "last reward", "claim", "final"], rows)


def _sources_table(units: dict[str, dict[str, Any]]) -> str:
    """GRPO on a mixture: each source's reward, completion length, truncation and share, averaged
    over the unit's steps (the `source/<env>/...` metrics)."""
    rows = []
    for name, unit in sorted(units.items()):
        found: dict[str, dict[str, list[float]]] = {}
        for m in unit["metrics"]:
            for k, v in m.items():
                if k.startswith("source/") and isinstance(v, (int, float)):
                    source, what = k[len("source/") :].rsplit("/", 1)
                    found.setdefault(source, {}).setdefault(what, []).append(float(v))
        for source, got in sorted(found.items()):
            mean = lambda what: sum(got[what]) / len(got[what]) if got.get(what) else None  # noqa: E731
            rows.append([name, source, len(got.get("reward", [])), mean("reward"), mean("length"), mean("truncated"), mean("share")])
    if not rows:
        return ""
    return "<h3>Mixtures: per source, mean over steps</h3>" + html_table(["unit", "source", "steps", "reward", "length", "truncated", "share"], rows)


def _eval_tables(evals: list[dict[str, Any]]) -> str:
    parts = []
    for e in evals:
        table = e["table"]
        cols = [c for c in e.get("shards", []) if c != "overall" and any(c in row for row in table.values())]
        cols += sorted({c for row in table.values() for c in row} - set(cols) - {"overall"}) + (["overall"] if any("overall" in r for r in table.values()) else [])
        labels = e.get("labels") or {}
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(e["at"])) if e.get("at") else ""
        parts.append(f"<h3>{html.escape(str(e.get('metric', 'metric')))} on {html.escape(str(e.get('dataset', '?')))} ({html.escape(str(e.get('split', '')))}) <small>{when} UTC</small></h3>")
        parts.append(html_table(["model", *[labels.get(c, c) for c in cols]], [[m, *[row.get(c) for c in cols]] for m, row in table.items()], "eval"))
    return "".join(parts)


def _composed_table(composed: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, c in sorted(composed.items()):
        options = c.get("options") or {}
        if c.get("into") == "ensemble":
            fed = ", ".join(c.get("members") or {})
            mix = options.get("mix", "")
            router = f"router mixing (router/{options.get('router_name')})" if mix == "router" else f"{mix} mixing, prior {options.get('prior', '')}"
        else:
            fed = ", ".join(c.get("paths") or {}) or (f"fine-tuned from composed:{c['finetuned_from']}" if c.get("finetuned_from") else "")
            router = options.get("router") or (f"trained ({c.get('train')}, {c.get('steps')} steps)" if c.get("finetuned_from") else "")
        excluded = c.get("excluded") or {}
        out = ", ".join(excluded.get("paths") or []) or ", ".join(f"layer {k}: {v}" for k, v in (excluded.get("removed_experts") or {}).items() if v)
        rows.append([name, c.get("into", "moe"), fed, router, out or "none", c.get("family", "")])
    return html_table(["composed", "into", "from", "router", "opted out", "family"], rows)


CSS = """body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1200px;color:#222;padding:0 1rem}
h1{font-size:1.6rem;margin-bottom:.2rem}h2{margin-top:2rem;border-bottom:1px solid #ddd;padding-bottom:.2rem}
table{border-collapse:collapse;margin:.6rem 0;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}th{background:#f4f4f4}img{max-width:100%;border:1px solid #eee}
.missing{background:#fff6e0;border:1px solid #f0c36d;padding:.5rem 1rem}.meta{color:#666}small{color:#888;font-weight:normal}"""


def render(facts: dict[str, Any], images: dict[str, bytes], missing: list[str]) -> str:
    """The page: every chart embedded as a data: URI, every table as HTML."""
    meta = facts["meta"]
    base = meta.get("base") or {}
    img = {k: f"<img alt='{k}' src='data:image/png;base64,{base64.b64encode(v).decode()}'>" for k, v in images.items()}
    sections = [f"<h1>paths run report</h1><p class=meta>{html.escape(facts['run'])} · family {html.escape(str(base.get('family', '?')))} · "
                f"written {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC</p>"]
    if missing:
        sections.append("<div class=missing><b>Not in this run yet:</b><ul>" + "".join(f"<li>{html.escape(m)}</li>" for m in missing) + "</ul></div>")
    sections.append("<h2>Training</h2>")
    if facts["units"]:
        sections.append(_units_table(facts["units"], facts["claims"]))
        sections.append(_sources_table(facts["units"]))
    sections += [img[k] for k in ("loss", "reward") if k in img]
    if facts["datasets"]:
        sections.append("<h2>Routing: documents and tokens per path</h2>")
        rows = [[name, d["kind"], d.get("router") or "", len(d["paths"]), sum(e["train_docs"] for e in d["paths"].values()), sum(e["train_tokens"] for e in d["paths"].values())] for name, d in sorted(facts["datasets"].items())]
        sections.append(html_table(["dataset", "kind", "router", "paths", "documents", "tokens"], rows))
        sections.append(img.get("routing", ""))
    if "claims" in img:
        sections.append("<h2>Claims timeline</h2>" + img["claims"])
        takeovers = [t for t in facts["tenures"] if t["ended"] == "expired"]
        if takeovers:
            sections.append("<p>Leases that expired and were taken over:</p>" + html_table(["path", "worker", "generation", "held for (s)", "last step"], [[t["path"], t["worker"], t.get("generation"), float(t["until"]) - float(t["from"]), t.get("step")] for t in takeovers]))
    if facts["evals"]:
        sections.append("<h2>Evaluations</h2>" + _eval_tables(facts["evals"]))
    if facts["composed"]:
        sections.append("<h2>Composed models</h2>" + _composed_table(facts["composed"]))
    return f"<!doctype html><html><head><meta charset=utf-8><title>paths report: {html.escape(facts['run'])}</title><style>{CSS}</style></head><body>{''.join(sections)}</body></html>\n"


def write_report(run: Run, out: str, overwrite: bool = False) -> Report:
    """Write `out`/index.html and the charts as PNGs beside it (staged, then moved into place);
    NothingTrained after writing when the run has no trained unit yet."""
    if os.path.exists(out) and not overwrite:
        raise ConfigurationError(f"{out} already exists: pass --overwrite or choose another --out")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigurationError(f"{out} is a file, not a report folder: choose another --out")
    facts = gather(run)
    facts["tenures"] = timeline(facts["claims"], time.time())
    charts = {"loss": loss_chart(facts["units"]), "reward": reward_chart(facts["units"]), "routing": routing_chart(facts["datasets"]), "claims": claims_chart(facts["tenures"])}
    images = {k: v for k, v in charts.items() if v is not None}
    trained = sum(1 for u in facts["units"].values() if u["metrics"])
    missing = []
    if not trained:
        missing.append("nothing trained yet: no work/<unit>/metrics.jsonl (`paths claim && paths train`)")
    if not facts["datasets"]:
        missing.append("no dataset: shard one with `paths shard`")
    if not facts["claims"]:
        missing.append("no claims: nobody ran `paths claim`")
    if not facts["evals"]:
        missing.append("no evaluation in eval/ (`paths eval`)")
    if not facts["composed"]:
        missing.append("no composed model (`paths compose`)")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    staged = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.staging-{os.getpid()}")
    shutil.rmtree(staged, ignore_errors=True)
    os.makedirs(staged)
    try:
        for name, data in images.items():
            with open(os.path.join(staged, f"{name}.png"), "wb") as f:
                f.write(data)
        with open(os.path.join(staged, "index.html"), "w", encoding="utf-8") as f:
            f.write(render(facts, images, missing))
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(staged, out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    report = Report(os.path.join(out, "index.html"), [os.path.join(out, f"{k}.png") for k in images], missing, trained)
    if not trained:
        raise NothingTrained(f"{run.url} has nothing trained yet: wrote {report.index} with what exists ({', '.join(images) or 'no charts'}); train with `paths claim && paths train`")
    return report
