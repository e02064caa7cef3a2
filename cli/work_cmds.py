"""`paths claim`, `train`, `release`, `status`: the worker loop and its admin view."""

from __future__ import annotations

import click

from cli.render import as_json, render_status

run_arg = click.argument("run", envvar="PATHS_RUN")


@click.command("claim")
@run_arg
@click.option("--path", "path_id", help="Claim this path only (default: any claimable one).")
@click.option("--ttl", default=600.0, show_default=True, help="Lease length in seconds; `paths train` renews it.")
@click.option("--worker", help="Worker name recorded in the claim (default: hostname-<random>).")
def claim(run: str, path_id, ttl: float, worker) -> None:
    """Claim a path through the store; prints its id. Exit 3 when nothing is left to claim."""
    from paths.claims import claim as do, save_local
    from paths.decompose import decomposed_paths
    from storage.layout import open_run

    r = open_run(run)
    _, ids = decomposed_paths(r)
    if path_id is not None:
        if path_id not in ids:
            raise click.BadParameter(f"{path_id} is not a decomposed path of {run}", param_hint="--path")
        ids = [path_id]
    lease = do(r, ids, ttl=ttl, worker=worker)
    where = save_local(lease)
    click.echo(lease.path)
    click.echo(f"claimed {lease.path} as {lease.worker} (generation {lease.generation}, lease {ttl:.0f}s); recorded in {where}", err=True)


@click.command("train")
@click.argument("run", envvar="PATHS_RUN", required=False)
@click.option("--path", "path_id", help="The claimed path (default: the one `paths claim` recorded).")
@click.option("--mode", type=click.Choice(["lm", "sft"]), default="lm", show_default=True)
@click.option("--dataset", required=True, help="A dataset written by `paths shard` (prompts with --kind prompts for sft).")
@click.option("--steps", type=int, help="Optimizer steps (default: the config's).")
@click.option("--checkpoint-every", type=int, help="Steps between checkpoints.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="A TOML like configs/train/default.toml.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override one setting (repeatable), e.g. --set lr=1e-4.")
@click.option("--no-progress", is_flag=True, help="No progress bar (metrics still go to work/<path>/metrics.jsonl).")
def train(run, path_id, mode, dataset, steps, checkpoint_every, config_file, sets, no_progress) -> None:
    """Train the claimed path, renewing its lease; checkpoints and exact resume."""
    import os

    from paths.claims import load_local, resume_lease
    from paths.train import train as do
    from paths.train_config import load_config
    from storage.layout import open_run

    cfg = load_config(config_file, sets, steps=steps, checkpoint_every=checkpoint_every)
    if run is None:
        local = load_local()
        if local is None:
            raise click.UsageError("give RUN (or set PATHS_RUN), after `paths claim RUN`")
        run = local["run"]
    r = open_run(run)
    if int(os.environ.get("RANK", "0")) == 0:
        lease = resume_lease(r, path_id)
    else:  # other ranks of `accelerate launch` / torchrun: rank 0 holds and renews the lease
        local = load_local() or {}
        lease, path_id = None, path_id or local.get("path")
        if path_id is None:
            raise click.UsageError("give --path on every rank, or run `paths claim` where all ranks can read .paths/claim.json")
    summary = do(r, lease.path if lease else path_id, mode, dataset, cfg, lease, show_progress=not no_progress)
    if "final" in summary:  # rank 0 (other ranks write nothing)
        click.echo(f"trained {summary['path']}: {summary['steps']} steps, {summary['tokens']:,} tokens, final loss {summary['final_loss']:.4f} -> {summary['final']}")


@click.command("release")
@run_arg
@click.option("--path", "path_id", required=True)
@click.option("--state", type=click.Choice(["open", "failed"]), default="open", show_default=True, help="open: claimable again; failed: never claimed again.")
def release(run: str, path_id: str, state: str) -> None:
    """Admin override of a path's claim record (who and when are recorded)."""
    from paths.claims import release as do
    from storage.layout import open_run

    record = do(open_run(run), path_id, state)
    click.echo(f"{path_id}: {state} (released by {record['released_by']})")


@click.command("status")
@run_arg
@click.option("--json", "json_out", is_flag=True)
def status(run: str, json_out: bool) -> None:
    """Every path: state, worker, lease time left, generation, last committed step, tokens, loss."""
    from paths.status import status as do
    from storage.layout import open_run

    rows = do(open_run(run))
    click.echo(as_json(rows) if json_out else render_status(rows))
