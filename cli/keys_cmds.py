"""`paths keys ...`: rollout workers' Ed25519 keys and the run's allowlist of them."""

from __future__ import annotations

import time

import click

from cli.render import as_json

run_arg = click.argument("run", envvar="PATHS_RUN")


@click.group()
def keys() -> None:
    """Worker keys: who may send rollout batches to an asynchronous trainer."""


@keys.command("new")
@click.option("--out", help="Private key file to write (default: $PATHS_HOME/worker.key, else .paths/worker.key).")
@click.option("--overwrite", is_flag=True, help="Replace an existing key file.")
def new_cmd(out: str | None, overwrite: bool) -> None:
    """Create a worker's private key (0600) and FILE.pub, and print the public key (for `paths keys admit`)."""
    from paths.work.rollouts.keys import default_key_file, new_key

    path = out or default_key_file()
    public = new_key(path, overwrite)
    click.echo(f"wrote {path} and {path}.pub; public key: {public}")


@keys.command("show")
@click.option("--key", "key_file", help="Private key file (default: $PATHS_HOME/worker.key, else .paths/worker.key).")
def show_cmd(key_file: str | None) -> None:
    """Print the public key of a private key file."""
    from paths.work.rollouts.keys import default_key_file, load_key, public_hex

    click.echo(public_hex(load_key(key_file or default_key_file())))


@keys.command("admit")
@run_arg
@click.option("--name", required=True, help="The worker's name: its batches go to rollouts/<path>/batches/<name>/.")
@click.option("--key", "public", required=True, help="Its public key: 64 hex digits, as `paths keys new` prints them, or its FILE.pub.")
def admit_cmd(run: str, name: str, public: str) -> None:
    """Admit a worker's public key to the run (workers/allowlist.json)."""
    from paths.work.rollouts.keys import admit
    from storage.layout import open_run

    worker = admit(open_run(run), name, public)
    click.echo(f"admitted {worker.name} ({worker.key[:16]}...) to {run}")


@keys.command("revoke")
@run_arg
@click.argument("who")
def revoke_cmd(run: str, who: str) -> None:
    """Revoke a worker (by name or public key): trainers stop reading its batches."""
    from paths.work.rollouts.keys import revoke
    from storage.layout import open_run

    worker = revoke(open_run(run), who)
    click.echo(f"revoked {worker.name} ({worker.key[:16]}...) from {run}")


@keys.command("list")
@run_arg
@click.option("--json", "json_out", is_flag=True)
def list_cmd(run: str, json_out: bool) -> None:
    """The run's allowlist: open or closed, and each worker's key and state."""
    from paths.work.rollouts.keys import read_allowlist
    from storage.layout import open_run

    allow = read_allowlist(open_run(run))
    if json_out:
        click.echo(as_json(allow.to_json()))
        return
    click.echo(f"{run}: {'open (unsigned batches read too)' if allow.open else 'closed (signed batches of admitted workers only)'}")
    for w in sorted(allow.workers.values(), key=lambda w: w.name):
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(w.revoked_at or w.admitted_at))
        click.echo(f"  {w.name:<24} {w.key}  {'revoked' if w.revoked_at else 'admitted'} {when}")


@keys.command("open")
@run_arg
def open_cmd(run: str) -> None:
    """Let unsigned rollout batches in too (a run among trusted machines)."""
    from paths.work.rollouts.keys import set_open
    from storage.layout import open_run

    set_open(open_run(run), True)
    click.echo(f"{run}: open; unsigned rollout batches are read (strikes count per worker name)")


@keys.command("close")
@run_arg
def close_cmd(run: str) -> None:
    """Take signed batches of admitted workers only (the default)."""
    from paths.work.rollouts.keys import set_open
    from storage.layout import open_run

    set_open(open_run(run), False)
    click.echo(f"{run}: closed; only signed batches of admitted workers are read")
