"""`paths compose`: trained paths back into one MoE checkpoint."""

from __future__ import annotations

import os

import click

from cli.work_cmds import report_options

run_arg = click.argument("run", envvar="PATHS_RUN")


@click.command("compose")
@run_arg
@click.option("--into", type=click.Choice(["moe", "ensemble"]), default="moe", show_default=True, help="moe: one sparse MoE checkpoint of the base family; ensemble: members mixed per token (trust_remote_code).")
@click.option("--name", required=True, help="Output: composed/NAME/.")
@click.option("--paths", "select", help="Comma-separated path ids (default: every finished path).")
@click.option("--outer-lr", default=1.0, show_default=True, help="Outer learning rate on the mean delta.")
@click.option("--momentum", default=0.0, show_default=True, help="Nesterov momentum (0: none); state kept in composed/NAME/momentum.safetensors.")
@click.option("--previous", help="The composed model of the previous round, whose momentum state continues.")
@click.option("--weighting", type=click.Choice(["uniform", "tokens"]), default="uniform", show_default=True, help="Mean of deltas: uniform, or weighted by each path's trained tokens.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), help="Output dtype (default: the base's).")
@click.option("--router", type=click.Choice(["keep", "centroid", "domain-embed"]), default="keep", show_default=True,
              help="keep the base's routers; centroid: rows from routed data through the composed model; domain-embed: through each path's own model (FlexOlmo).")
@click.option("--router-data", help="centroid, domain-embed: the documents dataset the paths were trained on.")
@click.option("--router-docs", default=64, show_default=True, help="domain-embed: documents sampled per path.")
@click.option("--exclude", help="Opt-out: comma-separated path ids whose experts are removed (their data has no influence).")
@click.option("--include", help="Opt-out: keep only these paths; every other finished path's experts are removed.")
@click.option("--members", help="ensemble: comma-separated paths, experts or hf:DIR (default: every trained expert, else every trained path).")
@click.option("--mix", type=click.Choice(["posterior", "uniform", "router"]), default="posterior", show_default=True,
              help="ensemble: posterior (ELMForest: P(member | prefix)), uniform, or router (DiPaCo: one member per document by the saved router).")
@click.option("--prior", type=click.Choice(["cached", "uniform"]), default="cached", show_default=True, help="ensemble, posterior: the members' prior.")
@click.option("--prior-data", help="ensemble, --prior cached: the documents dataset whose held-out documents estimate it.")
@click.option("--prior-docs", default=100, show_default=True, help="ensemble: documents the cached prior is estimated on.")
@click.option("--prior-decay", default=0.3, show_default=True, help="ensemble: weight of each new document's posterior in the exponential average.")
@click.option("--router-name", help="ensemble, --mix router: the saved router (router/NAME/; default: the only one).")
@click.option("--overwrite", is_flag=True, help="Replace an existing composed/NAME/ (kept whole until the new one is complete).")
@click.option("--dry-run", is_flag=True, help="moe: print the plan (paths, opt-out, options, tensors and files to write) after every check; write nothing.")
def compose(run: str, into: str, name: str, select: str | None, outer_lr: float, momentum: float, previous: str | None, weighting: str, dtype: str | None,
            router: str, router_data: str | None, router_docs: int, exclude: str | None, include: str | None, members: str | None, mix: str, prior: str,
            prior_data: str | None, prior_docs: int, prior_decay: float, router_name: str | None, overwrite: bool, dry_run: bool) -> None:
    """Merge trained paths into composed/NAME/ (loads with AutoModelForCausalLM), or ensemble them."""
    from compose.merge import execute
    from compose.plan import plan_compose
    from paths.errors import ConfigurationError
    from storage.layout import open_run

    def ids(text: str):
        return [p.strip() for p in text.split(",") if p.strip()] if text is not None else None

    if into == "ensemble":
        if dry_run:
            raise ConfigurationError("--dry-run plans --into moe; an ensemble copies its members as they are: leave --dry-run out")
        from compose.ensemble import compose_ensemble

        record = compose_ensemble(open_run(run), name, members=ids(members), mix=mix, prior=prior, prior_data=prior_data, prior_docs=prior_docs,
                                  prior_decay=prior_decay, router_name=router_name, overwrite=overwrite)
        prior_text = f"; prior {', '.join(f'{m} {p:.3f}' for m, p in zip(record['order'], record['prior']))}" if record["prior"] else ""
        click.echo(f"ensembled {', '.join(record['order'])} into {run}/composed/{name} (mix {mix}{prior_text}) in {record['seconds']}s; "
                   "load with AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)")
        return

    r = open_run(run)
    plan = plan_compose(
        r, name, paths=ids(select), outer_lr=outer_lr, momentum=momentum, weighting=weighting, previous=previous, dtype=dtype,
        overwrite=overwrite, router=router, router_data=router_data, router_docs=router_docs, exclude=ids(exclude), include=ids(include),
    )
    if dry_run:
        from cli.render import render_compose_plan

        click.echo(render_compose_plan(plan.describe(r)))
        return
    record = execute(r, plan)
    touched = len(record["tensors"])
    click.echo(f"composed {len(record['paths'])} paths into {run}/composed/{name} ({touched} tensors updated) in {record['seconds']}s")
    click.echo(f"shared tensors: {record['shared']}")
    if record["excluded"]["paths"]:
        click.echo(_opted_out(record["excluded"]))


@click.command("eval")
@run_arg
@click.option("--dataset", required=True, help="A dataset written by `paths shard` (documents: perplexity; prompts: mean reward, per task for environments).")
@click.option("--model", "models", multiple=True, help="base, path:ID, expert:NAME, composed:NAME (an MoE or an ensemble) or hf:DIR; repeatable (default: base and every composed model).")
@click.option("--split", type=click.Choice(["heldout", "train"]), default="heldout", show_default=True)
@click.option("--seq-len", default=256, show_default=True, help="Window length for perplexity.")
@click.option("--max-tokens", default=50_000, show_default=True, help="Tokens scored per path shard at most.")
@click.option("--reward", "rewards", multiple=True, metavar="SPEC[=W]", help="Prompts: rewards to score with (default: the dataset's environments, else math_answer).")
@click.option("--samples", default=1, show_default=True, help="Prompts: also sample K completions at temperature 1 per prompt and report pass@K per task.")
@click.option("--max-new-tokens", default=32, show_default=True, help="Prompts: tokens per completion (per episode, for a multi-turn environment).")
@click.option("--pass-threshold", default=0.5, show_default=True, help="Prompts: a completion passes when its reward is at least this.")
@click.option("--json", "json_out", is_flag=True)
def evaluate(run: str, dataset: str, models: tuple[str, ...], split: str, seq_len: int, max_tokens: int, rewards: tuple[str, ...], samples: int, max_new_tokens: int,
             pass_threshold: float, json_out: bool) -> None:
    """Score models on every path shard of a dataset; a table here, JSON in eval/ of the run."""
    from cli.render import as_json, render_eval
    from compose.evaluate import evaluate as do
    from storage.layout import open_run

    from paths.units import default_eval_models

    r = open_run(run)
    result = do(r, dataset, list(models) or default_eval_models(r), split=split, seq_len=seq_len, max_tokens=max_tokens, rewards=list(rewards), samples=samples,
                max_new_tokens=max_new_tokens, pass_threshold=pass_threshold)
    click.echo(as_json(result) if json_out else render_eval(result))


@click.command("next-round")
@run_arg
@click.option("--from", "source", required=True, help="composed:NAME, the model that becomes the next round's base.")
def next_round(run: str, source: str) -> None:
    """Start the next round from a composed model (earlier rounds move to rounds/r<N>/)."""
    from compose.rounds import next_round as do
    from storage.layout import open_run

    name = _composed_name(source, "--from")
    out = do(open_run(run), name)
    click.echo(f"round {out['round']} started from composed/{name}: {out['paths']} paths decomposed again; round {out['round'] - 1} kept in {out['archive']}/")


@click.command("diloco")
@run_arg
@click.option("--rounds", type=int, help="Set up: R rounds (once, before the first claim).")
@click.option("--inner-steps", type=int, help="Set up: H inner steps of every path per round (a path trains R x H steps in all).")
@click.option("--outer-lr", default=0.7, show_default=True, help="Set up: outer learning rate on each module's mean delta (DiPaCo: 0.7).")
@click.option("--momentum", default=0.9, show_default=True, help="Set up: outer Nesterov momentum (0: plain averaging with --outer-lr 1).")
@click.option("--step", "compute", is_flag=True, help="Compute every outer step whose paths are all in and nobody computed (after a worker died computing one).")
@click.option("--json", "json_out", is_flag=True)
def diloco(run: str, rounds: int | None, inner_steps: int | None, outer_lr: float, momentum: float, compute: bool, json_out: bool) -> None:
    """DiLoCo rounds in place: set them up, or show (and with --step compute) their outer steps."""
    from cli.render import as_json
    from compose.diloco import outer_step
    from paths.errors import ConfigurationError
    from paths.work.diloco import configure, status
    from storage.layout import open_run

    r = open_run(run)
    if rounds is not None or inner_steps is not None:
        if rounds is None or inner_steps is None:
            raise ConfigurationError("set rounds up with both --rounds R and --inner-steps H")
        spec = configure(r, rounds, inner_steps, outer_lr, momentum)
        click.echo(f"{len(spec.paths)} paths will train {spec.rounds} rounds of {spec.every} steps ({spec.total} in all: `paths train` takes --steps {spec.total} by itself); "
                   f"outer step: lr {spec.outer_lr}, Nesterov momentum {spec.momentum}, into composed/round-<r>/", err=True)
    computed = []
    if compute:
        for n in range(1, (status(r) or {"rounds": 0})["rounds"] + 1):
            done = outer_step(r, n, worker="paths-diloco")
            if done is None:
                break
            computed.append(done)
    state = status(r)
    if state is None:
        raise ConfigurationError(f"{run} does not train in DiLoCo rounds: set them up with `paths diloco {run} --rounds R --inner-steps H`")
    state["computed"] = computed
    if json_out:
        click.echo(as_json(state))
        return
    click.echo(f"{state['paths']} paths, {state['rounds']} rounds of {state['every']} steps, outer lr {state['outer_lr']}, momentum {state['momentum']}: {state['rounds_done']} rounds done")
    for row in state["progress"]:
        late = row["paths_in"] - len(row.get("averaged", [])) if row["outer_step"] else 0
        click.echo(f"  round {row['round']}: {row['paths_in']}/{state['paths']} paths in, outer step {'composed/round-' + str(row['round']) if row['outer_step'] else 'not yet'}"
                   + (f" ({len(row['averaged'])} averaged, {late} in after it)" if late else ""))
    if state.get("dropped"):
        click.echo(f"  dropped (marked failed): {', '.join(state['dropped'])}; the outer steps average the other paths. `paths storage release {run} --path "
                   f"{state['dropped'][0]}` takes one back: it skips the rounds composed without it, goes on from the newest outer step, "
                   "and the rounds still to come wait for it")


@click.command("finetune-moe")
@run_arg
@click.option("--model", "source", required=True, help="composed:NAME, the MoE to fine-tune.")
@click.option("--dataset", required=True, help="A documents dataset; batches come from every path's shard in turn.")
@click.option("--out", help="Output: composed/OUT/ (default: NAME-ft).")
@click.option("--train", "what", type=click.Choice(["router", "all"]), default="router", show_default=True, help="router: only the routers learn (BTX's token-level routing); all: every weight.")
@click.option("--steps", type=int, help="Optimizer steps (default: the config's).")
@click.option("--aux-loss", default=0.01, show_default=True, help="Weight of the Switch load-balancing loss.")
@click.option("--moe-backend", type=click.Choice(["auto", "reference", "megablocks"]), default="auto", show_default=True, help="auto: megablocks on CUDA when installed, else the pure-torch reference.")
@click.option("--lora", "lora_rank", type=int, metavar="RANK", help="Train a LoRA adapter of this rank (beside the attention; --set lora_targets=...) and the routers in full; the result is merged.")
@click.option("--checkpoint-every", type=int, help="Steps between checkpoints (work/moe-OUT/).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="A TOML like configs/train/default.toml.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override one training setting (repeatable).")
@click.option("--overwrite", is_flag=True, help="Replace an existing composed/OUT/.")
@click.option("--no-progress", is_flag=True)
@report_options
def finetune_moe(run: str, source: str, dataset: str, out: str | None, what: str, steps: int | None, aux_loss: float, moe_backend: str, lora_rank: int | None, checkpoint_every: int | None, config_file: str | None, sets: tuple[str, ...], overwrite: bool, no_progress: bool, report_to: str | None, logging_dir: str | None) -> None:
    """Fine-tune a composed MoE's routing (Branch-Train-MiX) on data mixed from every path."""
    from compose.finetune import finetune_moe as do
    from paths.train_config import load_config
    from storage.layout import open_run

    name = _composed_name(source, "--model")
    cfg = load_config(config_file, sets, steps=steps, checkpoint_every=checkpoint_every, report_to=report_to, logging_dir=logging_dir, lora_rank=lora_rank)
    summary = do(open_run(run), name, dataset, out or f"{name}-ft", cfg, train=what, aux_loss=aux_loss, backend=moe_backend, overwrite=overwrite, show_progress=not no_progress)
    click.echo(f"fine-tuned {summary['train']} of composed/{name} for {summary['steps']} steps ({summary['tokens']:,} tokens, {summary['backend']}); "
               f"final loss {summary['final_loss']:.4f} -> {run}/composed/{summary['name']}")


def _composed_name(source: str, option: str) -> str:
    """NAME of a `composed:NAME` option (paths.models.parse_model), or a usage error (exit 2)."""
    from paths.errors import ConfigurationError
    from paths.models import parse_model

    try:
        return parse_model(source, kinds=("composed",), option=option).name
    except ConfigurationError:
        raise click.BadParameter(f"{source!r}: use composed:NAME", param_hint=option) from None


def _opted_out(excluded: dict) -> str:
    """`left out p02: experts [2] removed from every layer (3 left)`, or per layer where they differ."""
    removed, kept = excluded["removed_experts"], excluded["experts_kept"] or {}
    left = f" ({len(next(iter(kept.values())))} left)" if kept else ""
    if len({str(r) for r in removed.values()}) == 1:
        return f"left out {', '.join(excluded['paths'])}: experts {next(iter(removed.values()))} removed from every layer{left}"
    return f"left out {', '.join(excluded['paths'])}: experts removed per layer {removed}{left}"


@click.command("report")
@run_arg
@click.option("--out", help="Folder for index.html and the PNGs (default: reports/<run name>/).")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out folder.")
def report(run: str, out: str | None, overwrite: bool) -> None:
    """One self-contained HTML page of the run: loss and reward curves, routing, claims, evals, composed models."""
    from compose.report import write_report
    from storage.layout import open_run

    r = open_run(run)
    done = write_report(r, out or os.path.join("reports", r.url.rstrip("/").rsplit("/", 1)[-1]), overwrite=overwrite)
    for line in done.missing:
        click.echo(f"(not in this run yet: {line})")
    click.echo(f"wrote {done.index} ({len(done.images)} charts: {', '.join(os.path.basename(p) for p in done.images)})")
