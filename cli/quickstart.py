"""`paths quickstart`: run the main job on the embedded default and show each stage."""

from __future__ import annotations

import time

import click

from cli.render import render, render_dataset, render_plan
from paths.errors import IntegrityError
from paths.quickstart import DEFAULT_ROOT, stages
from storage.admin import VerifyReport


@click.command()
@click.option("--root", default=DEFAULT_ROOT, show_default=True, help="Folder (or s3:// URL) of the quickstart run.")
def quickstart(root: str) -> None:
    """Create a run on a local folder and walk it through every stage that exists."""
    start = time.perf_counter()
    for title, step in stages(root):
        click.secho(f"\n$ {title}", bold=True)
        result = step()
        if isinstance(result, dict) and "parameters_per_path" in result:
            click.echo(render_plan(result))
        elif isinstance(result, dict) and result.get("kind") == "dataset":
            click.echo(render_dataset({**result, "paths": {p: c for p, c in result["paths"].items() if c["train_docs"] + c["heldout_docs"]}}))
        elif isinstance(result, dict) and "bytes_written" in result:
            click.echo(f"{result['bytes_written']:,} bytes of tensors written, {result['tensor_bytes_read']:,} read from base/ in {result['seconds']}s")
        else:
            click.echo(result if isinstance(result, str) else render(result))
        if isinstance(result, VerifyReport) and not result.ok:
            raise IntegrityError(f"verify found {len(result.problems)} problems in {root}")
    click.echo(f"\nquickstart done in {time.perf_counter() - start:.1f}s")
