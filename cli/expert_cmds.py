"""`paths expert add|ls`: domain experts (HDEE / Branch-Train-Merge) of any size."""

from __future__ import annotations

import click

from cli.render import as_json

run_arg = click.argument("run", envvar="PATHS_RUN")


@click.group("expert")
def expert() -> None:
    """Register and list dense domain experts; they are claimed and trained like paths."""


@expert.command("add")
@run_arg
@click.option("--name", required=True, help="The expert's id (claims, work/NAME/, --members).")
@click.option("--domain", required=True, help="The domain whose documents it trains on (the `domain` field of the records).")
@click.option("--from", "from_dir", type=click.Path(file_okay=False), help="A dense HF causal LM folder (safetensors) with the run's tokenizer.")
@click.option("--preset", help="A size from configs/experts/ (tiny-xs, tiny-s, tiny-m, small-half, small, small-xl, 150m), built as the base family's dense model.")
@click.option("--branch-from", help="Start from another expert's trained final/ (Branch-Train-Merge).")
@click.option("--steps", type=int, help="Its step budget: what `paths train` runs when given no --steps.")
@click.option("--seed", default=0, show_default=True, help="--preset: initialisation seed.")
@click.option("--overwrite", is_flag=True, help="Replace an expert of that name.")
def add(run: str, name: str, domain: str, from_dir: str | None, preset: str | None, branch_from: str | None, steps: int | None, seed: int, overwrite: bool) -> None:
    """Register a domain expert in experts/NAME/."""
    from experts.domain import add_expert
    from storage.layout import open_run

    info = add_expert(open_run(run), name, domain, from_dir=from_dir, preset=preset, branch_from=branch_from, steps=steps, seed=seed, overwrite=overwrite)
    c = info["config"]
    budget = f"{info['steps']} steps" if info["steps"] else "the training config's steps"
    click.echo(f"expert {name} ({domain}): {c['model_type']}, {c['num_hidden_layers']} layers x {c['hidden_size']}, {info['parameters']:,} parameters, {budget}; claim it with `paths claim {run} --path {name}`")


@expert.command("ls")
@run_arg
@click.option("--json", "json_out", is_flag=True)
def ls(run: str, json_out: bool) -> None:
    """The registered experts: domain, size, step budget, whether trained."""
    from paths.units import list_experts
    from storage.layout import open_run

    r = open_run(run)
    experts = list_experts(r)
    rows = {n: {**e, "trained": r.store.exists(f"{r.final(n)}/manifest.json")} for n, e in experts.items()}
    if json_out:
        click.echo(as_json(rows))
        return
    if not rows:
        click.echo(f"no experts in {run}: add one with `paths expert add {run} --name NAME --domain D --preset tiny-s`")
        return
    width = max(len(n) for n in rows)
    click.echo(f"{'expert':{width}}  {'domain':10}  {'layers x hidden':15}  {'parameters':>11}  {'steps':>6}  trained")
    for n, e in rows.items():
        c = e["config"]
        click.echo(f"{n:{width}}  {e['domain']:10}  {str(c['num_hidden_layers']) + ' x ' + str(c['hidden_size']):15}  {e['parameters']:>11,}  {str(e['steps'] or '-'):>6}  {'yes' if e['trained'] else 'no'}")
