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
@click.option("--reward", "rewards", multiple=True, metavar="SPEC[=W]", help="Verifiers, as for paths train --mode grpo (default math_answer).")
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
