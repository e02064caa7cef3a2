"""`paths claim`, `train`, `release`, `status`: the worker loop and its admin view."""

from __future__ import annotations

from typing import Any

import click

from cli.render import as_json, render_status

run_arg = click.argument("run", envvar="PATHS_RUN")


def report_options(fn: Any) -> Any:
    """--report-to and --logging-dir: a copy of the metrics for an experiment tracker."""
    fn = click.option("--logging-dir", help="Where the tracker writes (default: tracking/; TensorBoard: DIR/<run>/<unit>/).")(fn)
    return click.option("--report-to", type=click.Choice(["none", "tensorboard", "wandb", "mlflow"]),
                        help="Also log every step's metrics to TensorBoard, W&B (offline unless WANDB_MODE) or MLflow (each an extra: pip install 'paths[NAME]').")(fn)


@click.command("claim")
@run_arg
@click.option("--path", "path_id", help="Claim this path or domain expert only (default: any claimable one).")
@click.option("--ttl", default=600.0, show_default=True, help="Lease length in seconds (at least 5); `paths train` renews it every ttl/3 from its start.")
@click.option("--worker", help="Worker name recorded in the claim (default: hostname-<random>).")
@click.option("--wait", default=0.0, show_default=True, help="DiLoCo rounds: seconds to keep trying while paths wait for a round's outer step (exit 75 after, where exit 3 means nothing is left).")
def claim(run: str, path_id: str | None, ttl: float, worker: str | None, wait: float) -> None:
    """Claim a path through the store; prints its id. Exit 3 when nothing is left to claim, 75
    when paths wait for a DiLoCo round's outer step (claim again later)."""
    import time

    from paths.units import claimable
    from paths.work.claims import check_home, check_ttl, save_local
    from paths.work.claims import claim as do
    from storage.layout import open_run

    check_home()
    r = open_run(run)
    ids = claimable(r, path_id)
    t0 = time.perf_counter()
    if ids:
        r.store.exists(r.claim(ids[0]))  # one round trip, to size a workable ttl
    check_ttl(ttl, time.perf_counter() - t0)
    lease = do(r, ids, ttl=ttl, worker=worker, wait=wait)
    where = save_local(lease)
    click.echo(lease.path)
    click.echo(f"claimed {lease.path} as {lease.worker} (generation {lease.generation}, lease {ttl:.0f}s); recorded in {where}", err=True)


@click.command("train")
@click.argument("run", envvar="PATHS_RUN", required=False)
@click.option("--path", "path_id", help="The claimed path (default: the one `paths claim` recorded).")
@click.option("--mode", type=click.Choice(["lm", "sft", "grpo"]), default="lm", show_default=True)
@click.option("--dataset", required=True, help="A dataset written by `paths shard` (prompts with --kind prompts for sft).")
@click.option("--steps", type=int, help="Optimizer steps (default: a domain expert's own budget, else the config's).")
@click.option("--checkpoint-every", type=int, help="Steps between checkpoints.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="A TOML like configs/train/default.toml.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override one setting (repeatable), e.g. --set lr=1e-4.")
@click.option("--no-progress", is_flag=True, help="No progress bar (metrics still go to work/<path>/metrics.jsonl).")
@click.option("--init", "init", type=click.Choice(["base", "final"]), default="base", show_default=True, help="Start from the path cut from base/, or from its work/<path>/final/ (e.g. grpo after lm).")
@click.option("--freeze", type=click.Choice(["none", "shared"]), help="shared: train only the path's experts; attention, embeddings, norms, head stay the base's (FlexOlmo).")
@click.option("--lora", "lora_rank", type=int, metavar="RANK", help="Train a LoRA adapter of this rank instead of every parameter (alpha, dropout, targets: --set lora_alpha=... lora_dropout=... lora_targets=attention,experts).")
@click.option("--quantize-base", type=click.Choice(["fp32", "int8", "nf4"]), help="With --lora: hold the frozen base in int8 (any device) or 4-bit NF4 (bitsandbytes, CUDA).")
@click.option("--fsdp/--no-fsdp", default=None, help="lm / sft over several processes: shard the path's parameters, gradients and AdamW moments across them (FSDP2).")
@click.option("--reward", "rewards", multiple=True, metavar="SPEC[=W]", help="grpo: math_answer, format, length_penalty, module:function, reasoning-gym:TASK, verifiers:MODULE or env, optional weight; repeatable (default: the dataset's environments, else math_answer).")
@click.option("--group-size", type=int, help="grpo: completions per prompt (>= 2).")
@click.option("--max-new-tokens", type=int, help="grpo: completion length limit.")
@click.option("--temperature", type=float, help="grpo: sampling temperature.")
@click.option("--top-p", type=float, help="grpo: nucleus sampling.")
@click.option("--beta", type=float, help="grpo: KL penalty to the starting weights (0: no reference model).")
@click.option("--epsilon", type=float, help="grpo: clip range below 1.")
@click.option("--epsilon-high", type=float, help="grpo: clip range above 1 (default: --epsilon).")
@click.option("--loss", type=click.Choice(["grpo", "bnpo", "dr_grpo", "dapo"]), help="grpo: loss normalisation (TRL's definitions).")
@click.option("--scale-rewards", type=click.Choice(["group", "batch", "none"]), help="grpo: advantage scaling.")
@click.option("--iterations", type=int, help="grpo: optimizer steps per rollout.")
@click.option("--dynamic-sampling/--no-dynamic-sampling", default=None, help="grpo: drop groups whose rewards are all equal and sample more prompts until the batch is full (DAPO).")
@click.option("--overlong", type=click.Choice(["none", "mask", "soft"]), help="grpo: completions cut at --max-new-tokens: keep, leave out of the loss, or penalise (with --set overlong_buffer=N).")
@click.option("--eval-every", type=int, help="grpo: held-out reward (greedy) every N steps, in the metrics as heldout_reward.")
@click.option("--rollouts", type=click.Choice(["local", "store"]), help="grpo: sample here (local), or consume verified batches of `paths rollout` workers through the run (store).")
@click.option("--max-async", type=int, help="grpo --rollouts store: how many policy versions a rollout batch may lag (default 2).")
@click.option("--external", type=int, help="grpo --rollouts store: SAPO, prompt groups per step taken from other paths' rollouts (re-scored here).")
@report_options
def train(run: str | None, path_id: str | None, mode: str, dataset: str, steps: int | None, checkpoint_every: int | None, config_file: str | None, sets: tuple[str, ...], no_progress: bool, init: str, rewards: tuple[str, ...], **grpo: Any) -> None:
    """Train the claimed path, renewing its lease; checkpoints and exact resume."""
    from paths.train_config import load_config
    from paths.work.claims import claimed_run, keep_alive, lease_for_rank
    from storage.layout import open_run

    cfg = load_config(config_file, sets, mode=mode, steps=steps, checkpoint_every=checkpoint_every, **grpo)  # bad settings fail first
    r = open_run(run or claimed_run())
    lease, path_id = lease_for_rank(r, path_id)
    beat = keep_alive(lease) if lease is not None else None  # renewing from now on: torch, materializing, resuming all come after
    try:
        from compose.diloco import train as do  # paths.work.train's, with a DiLoCo run's outer step
        from paths.work.train import unit_config

        cfg = unit_config(r, path_id, cfg, steps_given=steps is not None)
        summary = do(r, path_id, mode, dataset, cfg, lease, show_progress=not no_progress, rewards=list(rewards), init=init, heartbeat=beat)
    finally:
        if beat is not None:
            beat.stop()
    if "rollouts" in summary:
        click.echo(f"rollouts: {summary['rollouts']}")
    if "final" in summary:  # rank 0 (other ranks write nothing)
        click.echo(f"trained {summary['path']}: {summary['steps']} steps, {summary['tokens']:,} tokens, final loss {summary['final_loss']:.4f} -> {summary['final']}")
    if "waiting" in summary:
        click.echo(summary["waiting"])


@click.command("release")
@run_arg
@click.option("--path", "path_id", required=True)
@click.option("--state", type=click.Choice(["open", "failed"]), default="open", show_default=True, help="open: claimable again; failed: never claimed again.")
def release(run: str, path_id: str, state: str) -> None:
    """Admin override of a path's claim record (who and when are recorded)."""
    from paths.work.claims import release as do
    from storage.layout import open_run

    record = do(open_run(run), path_id, state)
    click.echo(f"{path_id}: {state} (released by {record['released_by']})")


@click.command("status")
@run_arg
@click.option("--json", "json_out", is_flag=True)
def status(run: str, json_out: bool) -> None:
    """Every path: state, worker, lease time left, generation, last committed step, tokens, loss."""
    from paths.work.status import status as do
    from storage.layout import open_run

    rows = do(open_run(run))
    click.echo(as_json(rows) if json_out else render_status(rows))


@click.command("gen-tasks")
@click.argument("kind", type=click.Choice(["arithmetic"]))
@click.option("--n", "n", required=True, type=int, help="Number of prompts.")
@click.option("--levels", default="1,2,3", show_default=True, help="Difficulty levels (operations per problem, 1-5), comma-separated.")
@click.option("--families", default="mixed,word", show_default=True, help="Task families to cycle through: add, sub, mul, mixed, word (comma-separated).")
@click.option("--max-operand", type=int, help="Draw every operand from 1..N (multipliers 2..N); default: first 1..20, others 2..12.")
@click.option("--seed", default=0, show_default=True)
@click.option("--out", required=True, help="Output JSONL: a file or an fsspec URL.")
def gen_tasks(kind: str, n: int, levels: str, families: str, max_operand: int | None, seed: int, out: str) -> None:
    """Write RL prompts with exact answers (JSONL: id, level, family, prompt, answer, solution)."""
    from collections import Counter

    from paths.work.tasks import arithmetic, write_jsonl

    try:
        level_list = [int(x) for x in levels.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{levels!r}: give numbers like 1,2,3", param_hint="--levels") from None
    records = arithmetic(n, level_list, seed, [x.strip() for x in families.split(",") if x.strip()], max_operand)
    write_jsonl(records, out)
    counts = ", ".join(f"{f} {c}" for f, c in Counter(r["family"] for r in records).items())
    click.echo(f"wrote {len(records)} {kind} prompts (levels {levels}; {counts}) to {out}")
