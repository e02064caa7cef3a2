"""`paths storage ...`: bucket and run administration."""

from __future__ import annotations

from dataclasses import asdict

import click

from cli.render import as_json, render, render_claims
from storage import admin
from storage.layout import open_run

url_arg = click.argument("url", envvar="PATHS_RUN")
json_opt = click.option("--json", "as_json_", is_flag=True, help="Print JSON for scripts.")


@click.group()
def storage() -> None:
    """Manage run storage: a local folder or s3://bucket/prefix."""


@storage.command("init")
@url_arg
def init_cmd(url: str) -> None:
    """Create the bucket or folder if absent and write the layout marker (run.json)."""
    run = admin.init(url)
    click.echo(f"initialised {run.url}")


@storage.command("ls")
@url_arg
@click.option("--prefix", default="", help="Only objects under this key prefix (e.g. work/p00-01).")
@json_opt
def ls_cmd(url: str, prefix: str, as_json_: bool) -> None:
    """List the objects of a run."""
    objects = admin.ls(open_run(url), prefix)
    click.echo(as_json([asdict(o) for o in objects]) if as_json_ else render(objects))


@storage.command("du")
@url_arg
@json_opt
def du_cmd(url: str, as_json_: bool) -> None:
    """Bytes and objects per area and per path."""
    usage = admin.du(open_run(url))
    click.echo(as_json(usage.as_json()) if as_json_ else render(usage))


@storage.command("verify")
@url_arg
@json_opt
def verify_cmd(url: str, as_json_: bool) -> None:
    """Recompute every checksum; exit 1 and list problems if any object is missing or differs."""
    report = admin.verify(open_run(url))
    click.echo(as_json(report.as_json()) if as_json_ else render(report))
    if not report.ok:
        raise SystemExit(1)


@storage.command("gc")
@url_arg
@click.option("--older-than", default="1h", show_default=True, help="Age of uncommitted checkpoints to remove (90s, 30m, 2h, 7d).")
@click.option("--keep", default=2, show_default=True, help="Committed checkpoints to keep per path.")
@click.option("--yes", is_flag=True, help="Delete; without it, only print what would be deleted.")
@json_opt
def gc_cmd(url: str, older_than: str, keep: int, yes: bool, as_json_: bool) -> None:
    """Remove stale uncommitted checkpoints and all but the newest committed ones."""
    run = open_run(url)
    plan = admin.gc_plan(run, admin.parse_duration(older_than), keep)
    if as_json_:
        click.echo(as_json({"deleted": yes, "items": [asdict(i) for i in plan]}))
    else:
        click.echo(render(plan))
    if yes:
        removed = admin.gc_apply(run, plan)
        if not as_json_:
            click.echo(f"removed {removed} objects")
    elif plan and not as_json_:
        click.echo("dry run: pass --yes to delete")


@storage.command("claims")
@url_arg
@json_opt
def claims_cmd(url: str, as_json_: bool) -> None:
    """List lease records."""
    records = admin.claims(open_run(url))
    click.echo(as_json(records) if as_json_ else render_claims(records))

