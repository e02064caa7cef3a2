"""`paths quickstart`: run the main job on the embedded default and show each stage."""

from __future__ import annotations

import time

import click

from cli import scenarios
from cli.render import render, render_dataset, render_plan
from paths.errors import IntegrityError
from storage.admin import VerifyReport


SCENARIOS = {
    "main": (scenarios.stages, scenarios.DEFAULT_ROOT),
    "flexolmo": (scenarios.flexolmo_stages, scenarios.FLEX_ROOT),
}


@click.command()
@click.option("--scenario", type=click.Choice([*SCENARIOS, "all"]), default="main", show_default=True,
              help="main: decompose, shard, train, GRPO, compose, eval; flexolmo: anchored domain experts and opt-out; all: each in turn.")
@click.option("--root", help="Folder (or s3:// URL) of the quickstart run (default: runs/quickstart[-SCENARIO]).")
def quickstart(scenario: str, root: str | None) -> None:
    """Create a run on a local folder and walk it through every stage that exists."""
    start = time.perf_counter()
    for name in SCENARIOS if scenario == "all" else [scenario]:
        stages, default_root = SCENARIOS[name]
        if scenario == "all":
            click.secho(f"\n=== scenario {name} ===", bold=True)
        suffix = f"-{name}" if scenario == "all" and name != "main" else ""
        _walk(stages, root + suffix if root else default_root)
    click.echo(f"\nquickstart done in {time.perf_counter() - start:.1f}s")


def _walk(stages, root: str) -> None:
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
