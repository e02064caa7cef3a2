"""`paths shard` and `paths route`: routing documents to paths and writing their shards."""

from __future__ import annotations

import sys
from typing import Any

import click

from cli.render import render_dataset

run_arg = click.argument("run", envvar="PATHS_RUN")
FORMATS = click.Choice(["auto", "jsonl", "parquet", "text"])


def _fields_options(f: Any):
    for option in reversed([
        click.option("--format", "fmt", type=FORMATS, default="auto", show_default=True, help="Input format; auto: by file name (.jsonl[.gz|.zst], .parquet, else text: one document per file)."),
        click.option("--text-field", default="text", show_default=True, help="Record field holding the document (the prompt, for --kind prompts)."),
        click.option("--id-field", help="Record field holding a stable document id (hashing and holdout use it; default: the text)."),
        click.option("--domain-field", help="Record field naming the domain (the domain router)."),
        click.option("--on-error", type=click.Choice(["fail", "skip"]), default="fail", show_default=True, help="A malformed line, missing field or non-UTF-8 record: stop, or skip and count it."),
    ]):
        f = option(f)
    return f


@click.command("shard")
@run_arg
@click.option("--dataset", required=True, help="Dataset name: data/NAME/ in the run.")
@click.option("--input", "inputs", required=True, multiple=True, help="File, glob or URL (s3://, gzip/zstd JSONL included), or an environment (verifiers:MODULE, reasoning-gym:TASK); repeatable.")
@_fields_options
@click.option("--answer-field", help="Record field with the answer (--kind prompts; default 'answer').")
@click.option("--system-prompt", help="Prompts: a system message put first; every prompt is then rendered with the chat template.")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False), help="Prompts: a Jinja chat template file, instead of the run tokenizer's own.")
@click.option("--kind", type=click.Choice(["documents", "prompts"]), default="documents", show_default=True, help="documents: token streams for lm; prompts: prompt + answer per path for RL.")
@click.option("--router", type=click.Choice(["hash", "domain", "moe", "kmeans"]), default="hash", show_default=True)
@click.option("--targets", type=click.Choice(["paths", "domains"]), default="paths", show_default=True, help="domains (with --router domain): one shard per registered expert domain, read by every expert of that domain.")
@click.option("--router-name", help="Save the router as router/NAME/ (default: the dataset name).")
@click.option("--domain-map", type=click.Path(dir_okay=False), help="JSON/TOML table: domain = path id (or expert index on one-level plans).")
@click.option("--features-model", type=click.Path(file_okay=False), help="kmeans: an HF encoder folder for features (default: the base model's hidden states).")
@click.option("--prefix-tokens", default=32, show_default=True, help="moe/kmeans: tokens of each document the router looks at.")
@click.option("--fit-sample", default=2048, show_default=True, help="kmeans: documents the centroids are fitted on (the first ones).")
@click.option("--balance/--no-balance", default=None, help="Cap each path at (1+slack)*N/P documents (default: on, except for the domain router).")
@click.option("--slack", default=0.1, show_default=True, help="Capacity slack for --balance.")
@click.option("--holdout", default=0.01, show_default=True, help="Share of documents held out per path (by a stable hash of the id).")
@click.option("--workers", default=1, show_default=True, help="Input files staged in parallel.")
@click.option("--limit", type=int, help="Stop after this many documents.")
@click.option("--seed", default=0, show_default=True, help="Seed of the k-means fit.")
@click.option("--overwrite", is_flag=True, help="Replace a dataset (and the router it made) written with other options.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest's summary as JSON.")
def shard(run: str, dataset: str, inputs: tuple[str, ...], fmt: str, text_field: str, id_field: str | None, domain_field: str | None, on_error: str, answer_field: str | None,
          system_prompt: str | None, chat_template: str | None, kind: str, router: str, targets: str, router_name: str | None, domain_map: str | None, features_model: str | None, prefix_tokens: int, fit_sample: int, balance, slack: float, holdout: float, workers: int, limit: int | None, seed: int, overwrite: bool, as_json: bool) -> None:
    """Route documents (or prompts) to paths and write data/DATASET/<path>.zarr, manifest last.

    --input also takes environments: verifiers:MODULE[:k=v,...] or reasoning-gym:TASK[:k=v,...]
    (with --kind prompts): their train rows, and their eval rows as the held-out split."""
    from sharding.shard import ShardOptions
    from sharding.shard import shard as do
    from storage.layout import open_run

    opts = ShardOptions(
        dataset=dataset, inputs=list(inputs), format=fmt, text_field=text_field, id_field=id_field,
        domain_field=domain_field, answer_field=answer_field, kind=kind, router=router, targets=targets, router_name=router_name,
        domain_map=domain_map, features_model=features_model, prefix_tokens=prefix_tokens, fit_sample=fit_sample,
        balance=balance, slack=slack, holdout=holdout, limit=limit, on_error=on_error, seed=seed, system_prompt=system_prompt,
        chat_template=open(chat_template).read() if chat_template else None,
    )
    with _Progress() as progress:
        manifest = do(open_run(run), opts, overwrite=overwrite, workers=workers, progress=progress)
    click.echo(render_dataset(manifest, as_json))


@click.command("route")
@run_arg
@click.option("--router", "router_name", required=True, help="A saved router: router/NAME/ (a dataset's name by default).")
@click.option("--input", "inputs", required=True, multiple=True, help="JSONL (or any --format) files, globs or URLs.")
@_fields_options
@click.option("--top", default=1, show_default=True, help="Also list the best N paths with their scores.")
@click.option("--out", type=click.File("w"), default="-", help="Output JSONL (default: stdout).")
def route(run: str, router_name: str, inputs: tuple[str, ...], fmt: str, text_field: str, id_field: str | None, domain_field: str | None, on_error: str, top: int, out: str) -> None:
    """Route new documents with a saved router: JSONL in, JSONL with path ids out."""
    from sharding.inputs import Fields
    from sharding.route import route as do
    from storage.layout import open_run

    counts = do(open_run(run), router_name, list(inputs), out, fmt=fmt, fields=Fields(text_field, id_field, domain_field), on_error=on_error, top=top)
    summary = ", ".join(f"{p}: {n}" for p, n in sorted(counts.items()))
    click.echo(f"routed {sum(counts.values())} documents ({summary})", err=True)


class _Progress:
    """tqdm bars for documents read and paths written, on stderr."""

    def __enter__(self):
        from tqdm import tqdm

        self.bars = {
            "docs": tqdm(desc="documents", unit="doc", file=sys.stderr, disable=None),
            "file": tqdm(desc="inputs staged", unit="file", file=sys.stderr, disable=None),
            "path": tqdm(desc="paths written", unit="path", file=sys.stderr, disable=None),
        }
        return self

    def __call__(self, event: str, n: int) -> None:
        self.bars[event].update(n)

    def __exit__(self, *exc) -> None:
        for bar in self.bars.values():
            bar.close()
