"""One page of the method benches, the way `paths report` shows a run: the trained seed, the DiPaCo
table (with DiLoCo rounds), the BTX per-domain table, each with its reproduce command, and the
training curves of the runs they left under bench/out/.

    .venv/bin/python bench/page.py [--out bench/out/page]

Reads the newest record of bench/out/dipaco.jsonl and bench/out/btx.jsonl, the cached seeds'
seed.json, and the runs' work/<unit>/metrics.jsonl; writes OUT/index.html with its charts embedded.
"""

from __future__ import annotations

import argparse
import base64
import glob
import html
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "bench", "out")


def newest(name: str) -> dict | None:
    path = os.path.join(OUT, f"{name}.jsonl")
    if not os.path.exists(path):
        return None
    lines = [line for line in open(path).read().splitlines() if line.strip()]
    return json.loads(lines[-1]) if lines else None


def metrics(run: str, unit: str) -> list[dict]:
    path = os.path.join(run, "work", unit, "metrics.jsonl")
    return [json.loads(line) for line in open(path).read().splitlines() if line.strip()] if os.path.exists(path) else []


def mean_curve(run: str) -> tuple[list[int], list[float]]:
    """The mean training loss over the run's paths at each step."""
    curves = [metrics(run, u) for u in sorted(os.listdir(os.path.join(run, "work"))) if not u.startswith("moe-")] if os.path.isdir(os.path.join(run, "work")) else []
    curves = [c for c in curves if c]
    if not curves:
        return [], []
    n = min(len(c) for c in curves)
    return list(range(1, n + 1)), [sum(c[i]["loss"] for c in curves) / len(curves) for i in range(n)]


def chart(title: str, lines: dict[str, tuple[list[int], list[float]]], smooth: int = 10) -> str:
    from compose.report import line_style, png, pyplot

    lines = {k: v for k, v in lines.items() if v[0]}
    if not lines:
        return ""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for i, (name, (x, y)) in enumerate(lines.items()):
        avg = [sum(y[max(0, j - smooth + 1): j + 1]) / len(y[max(0, j - smooth + 1): j + 1]) for j in range(len(y))]
        ax.plot(x, avg, lw=1.3, label=name, **line_style(i))
    ax.set(title=title, xlabel="optimizer step", ylabel=f"training loss (mean of {smooth} steps)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    return f"<img alt='{html.escape(title)}' src='data:image/png;base64,{base64.b64encode(png(fig)).decode()}'>"


def main() -> None:
    from compose.report import CSS, html_table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(OUT, "page"))
    a = ap.parse_args()
    parts = [f"<h1>paths: does the method pay off?</h1><p class=meta>benches from a trained seed, this machine; written {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC</p>"]

    seeds = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(OUT, "seed", "*", "seed.json")))]
    if seeds:
        parts.append("<h2>The trained seed</h2><p>A dense model of path size trained on the corpus; every method starts from it (upcycled: every expert a copy of its MLP).</p>")
        parts.append(html_table(["preset", "steps", "lr", "held-out perplexity", "documents", "train s", "sha256", "reproduce"],
                                [[s["preset"], s["steps"], s["lr"], s["heldout_perplexity"], s["heldout_documents"], round(s["train_seconds"]), s["sha256"][:12], s["reproduce"]] for s in seeds]))

    dipaco = newest("dipaco")
    if dipaco:
        n, r = dipaco["steps"], dipaco.get("rounds")
        parts.append(f"<h2>DiPaCo: 16 paths of {dipaco['preset']}, N = {n} steps each</h2>")
        parts.append(html_table(["model", "held-out perplexity", "/ dense N", "/ dense 16N"],
                                [[k, v, dipaco["ratio_vs_dense_n"][k], dipaco["ratio_vs_dense_16n"][k]] for k, v in dipaco["perplexity"].items()]))
        parts.append(f"<p class=meta>seconds: {html.escape(json.dumps({k: round(v) for k, v in dipaco['seconds'].items()}))}; reproduce: "
                     f"<code>.venv/bin/python bench/dipaco.py --preset {dipaco['preset']} --steps {n} --rounds {r} --seed-steps {dipaco['seed']['steps']}</code></p>")
        work = os.path.join(OUT, "dipaco")
        parts.append(chart("DiPaCo: training loss", {
            "16 paths, one round (mean over paths)": mean_curve(os.path.join(work, "paths")),
            f"16 paths, {r} DiLoCo rounds (mean over paths)": mean_curve(os.path.join(work, "diloco")),
            "dense N (the seed continued)": mean_curve(os.path.join(work, "dense-n")),
            "dense 16N (the seed continued)": mean_curve(os.path.join(work, "dense-16n")),
        }))

    btx = newest("btx")
    if btx:
        table = btx["perplexity"]
        cols = [c for c in next(iter(table.values())) if c != "overall"] + ["overall"]
        parts.append(f"<h2>Branch-Train-MiX: {len(cols) - 1} domains, N = {btx['steps']} steps per branch, M = {btx['ft_steps']} steps of finetune-moe</h2>")
        parts.append(html_table(["model", *cols], [[k, *(row[c] for c in cols)] for k, row in table.items()]))
        parts.append(f"<p class=meta>seconds: {html.escape(json.dumps({k: round(v) for k, v in btx['seconds'].items()}))}; reproduce: "
                     f"<code>.venv/bin/python bench/btx.py --preset {btx['preset']} --steps {btx['steps']} --ft-steps {btx['ft_steps']} --seed-steps {btx['seed']['steps']}</code></p>")
        work = os.path.join(OUT, "btx")
        lines = {(f"finetune-moe ({u[4:]}, steps take each domain in turn)" if u.startswith("moe-") else f"branch {u}"): ([m["step"] for m in metrics(os.path.join(work, "btx"), u)], [m["loss"] for m in metrics(os.path.join(work, "btx"), u)])
                 for u in sorted(os.listdir(os.path.join(work, "btx", "work")))} if os.path.isdir(os.path.join(work, "btx", "work")) else {}
        lines["dense 3N + M (the seed continued)"] = mean_curve(os.path.join(work, "dense-total"))
        parts.append(chart("BTX: training loss (branches, finetune-moe, dense)", lines))

    os.makedirs(a.out, exist_ok=True)
    page = f"<!doctype html><html><head><meta charset=utf-8><title>paths benches</title><style>{CSS}</style></head><body>{''.join(parts)}</body></html>\n"
    tmp = os.path.join(a.out, ".index.html.tmp")
    with open(tmp, "w") as f:
        f.write(page)
    os.replace(tmp, os.path.join(a.out, "index.html"))
    print(f"wrote {os.path.join(a.out, 'index.html')}")


if __name__ == "__main__":
    main()
