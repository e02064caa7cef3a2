"""`paths rejection-sample`: verified completions of a trained model, as an sft dataset."""

from __future__ import annotations

import click


@click.command("rejection-sample")
@click.argument("run", envvar="PATHS_RUN")
@click.option("--model", "model_spec", required=True, help="path:ID, expert:NAME, composed:NAME, base or hf:DIR.")
@click.option("--dataset", required=True, help="A prompt dataset (paths shard --kind prompts).")
@click.option("--shard", help="The path shard whose prompts are sampled (default: the --model path's own).")
@click.option("--split", type=click.Choice(["train", "heldout"]), default="train", show_default=True)
@click.option("--n", "n", default=8, show_default=True, help="Completions sampled per prompt.")
@click.option("--keep", default=1, show_default=True, help="Distinct accepted completions kept per prompt.")
@click.option("--reward", "rewards", multiple=True, metavar="SPEC[=W]", help="Verifiers, as for paths train --mode grpo (default: the dataset's environments, else math_answer).")
@click.option("--min-reward", default=1.0, show_default=True, help="A completion is kept when its weighted reward reaches this.")
@click.option("--max-new-tokens", default=32, show_default=True)
@click.option("--temperature", default=1.0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--limit", type=int, help="Only the first N prompts.")
@click.option("--seed", default=0, show_default=True)
@click.option("--out", required=True, help="Output JSONL (a file or fsspec URL): id, prompt, completion, gold, reward and the prompt's fields.")
@click.option("--no-progress", is_flag=True)
def rejection_sample(run: str, model_spec: str, dataset: str, shard: str | None, split: str, n: int, keep: int, rewards: tuple[str, ...], min_reward: float,
                     max_new_tokens: int, temperature: float, top_p: float, limit: int | None, seed: int, out: str, no_progress: bool) -> None:
    """Sample N completions per prompt, keep those the verifiers accept, write them for --mode sft
    (shard the file with --kind prompts --answer-field completion)."""
    from paths.work.rejection import rejection_sample as do
    from storage.layout import open_run

    r = do(open_run(run), model_spec, dataset, out, shard=shard, split=split, n=n, keep=keep, rewards=list(rewards), min_reward=min_reward,
           max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, limit=limit, seed=seed, show_progress=not no_progress)
    click.echo(f"kept {r['kept']} of {r['sampled']} completions ({r['prompts_solved']} of {r['prompts']} prompts solved at least once) from {model_spec} -> {out}")


@click.command("rollout")
@click.argument("run", envvar="PATHS_RUN")
@click.option("--path", "path_id", required=True, help="The path whose asynchronous trainer this worker feeds.")
@click.option("--dataset", required=True, help="The prompt dataset the trainer trains on.")
@click.option("--worker", help="This worker's name: the one its key was admitted under (found from the key), or in an open run any name (default: hostname-random).")
@click.option("--key", "key_file", help="Ed25519 private key that signs the batches (default: $PATHS_HOME/worker.key, else .paths/worker.key, when it exists; `paths keys new`).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "int8"]), default="fp32", show_default=True, help="Sample in this precision; int8: int8 linear layers and experts, activations quantized per token (QuaRL).")
@click.option("--batches", default=1, show_default=True, help="Rollout batches to write, then stop.")
@click.option("--wait", default=600.0, show_default=True, help="Seconds to wait for the trainer's first policy version.")
@click.option("--reward", "rewards", multiple=True, metavar="SPEC[=W]", help="Verifiers, as the trainer's (it recomputes them anyway; default: the dataset's environments, else math_answer).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="A TOML like configs/train/grpo.toml (batch_size, group_size, max_new_tokens, temperature).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override one setting (repeatable): must match the trainer's batch_size, group_size, temperature, top_p.")
@click.option("--no-progress", is_flag=True)
def rollout(run: str, path_id: str, dataset: str, worker: str | None, key_file: str | None, dtype: str, batches: int, wait: float, rewards: tuple[str, ...], config_file: str | None,
            sets: tuple[str, ...], no_progress: bool) -> None:
    """A rollout worker: sample batches from the newest published policy of a path and write them
    to the run for `paths train --mode grpo --rollouts store` (runs on CPU machines too)."""
    from tqdm import tqdm

    import os

    from paths.train_config import load_config
    from paths.work.episodes import dataset_scoring
    from paths.work.rollouts import load_key, rollout_worker
    from paths.work.rollouts.keys import default_key_file
    from storage.layout import open_run

    cfg = load_config(config_file, sets, mode="grpo")
    key = load_key(key_file) if key_file else load_key(default_key_file()) if os.path.exists(default_key_file()) else None
    reward_fns, episodes = dataset_scoring(open_run(run), dataset, list(rewards))
    bar = tqdm(total=batches, desc=f"rollout {path_id} ({worker or 'worker'}, {dtype})", disable=no_progress)

    def shown(b: dict) -> None:
        bar.update(1)
        bar.set_postfix(version=b["version"], reward=f"{b['reward_mean']:.3f}", tok_s=f"{b['tokens_per_s']:,.0f}")

    try:
        summary = rollout_worker(open_run(run), path_id, dataset, cfg, reward_fns, worker=worker, key=key, dtype=dtype, batches=batches, wait=wait, on_batch=shown,
                                 episodes=episodes)
    finally:
        bar.close()
    signed = f"signed by {summary['key'][:16]}..." if summary["key"] else "unsigned"
    click.echo(f"wrote {summary['batches']} rollout batches of {path_id} as {summary['worker']} ({signed}, {dtype}, last policy version {summary['last_version']}, "
               f"{summary['tokens_per_s']:,.0f} tokens/s, {summary['dropped_stale']} dropped as too stale, {summary['reloads']} policy loads)")
