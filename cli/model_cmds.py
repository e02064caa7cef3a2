"""`paths init`, `upcycle`, `plan`, `decompose`, `materialize`: getting an MoE and cutting it."""

from __future__ import annotations

import click

from cli.render import as_json, render_plan

run_arg = click.argument("run", envvar="PATHS_RUN")


@click.command("init")
@run_arg
@click.option("--preset", help="A preset in configs/models/ (tiny-mixtral, tiny-qwen3moe, dipaco-16x16-150m).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="A model TOML like the presets.")
@click.option("--from", "from_dir", type=click.Path(file_okay=False), help="An existing MoE checkpoint folder (HF format, safetensors).")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(file_okay=False), help="A tokenizer folder; default: one shipped with --from, else a byte-level BPE trained on local text.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random initialisation.")
@click.option("--dry-run", is_flag=True, help="Print the plan and parameter counts; write nothing.")
def init(run: str, preset: str | None, config_file: str | None, from_dir: str | None, tokenizer_dir: str | None, seed: int, dry_run: bool) -> None:
    """Create a run holding an MoE base model (base/, tokenizer/, run.json)."""
    from paths.prepare.init import init_plan, init_run

    if dry_run:
        click.echo(render_plan(init_plan(preset, config_file)))
        return
    meta = init_run(run, preset=preset, config_file=config_file, from_dir=from_dir, tokenizer_dir=tokenizer_dir, seed=seed)
    b = meta["base"]
    click.echo(f"initialised {run}: {b['family']} MoE, {b['num_layers']} layers x {b['num_experts']} experts; tokenizer {meta['tokenizer']['vocab_size']} tokens ({meta['tokenizer']['source']})")


@click.command("upcycle")
@run_arg
@click.option("--from", "from_dir", required=True, type=click.Path(file_okay=False), help="A dense checkpoint folder (Mistral or Qwen3).")
@click.option("--experts", required=True, type=int, help="Experts per layer.")
@click.option("--top-k", default=2, show_default=True, help="Experts per token.")
@click.option("--noise", default=0.0, show_default=True, help="Gaussian noise added to each expert copy, as a fraction of the weight's std.")
@click.option("--seed", default=0, show_default=True)
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(file_okay=False))
def upcycle(run: str, from_dir: str, experts: int, top_k: int, noise: float, seed: int, tokenizer_dir: str | None) -> None:
    """Sparse upcycling: an MoE whose experts all start as the dense model's MLP."""
    from paths.prepare.init import upcycle as do

    meta = do(run, from_dir, experts, top_k, noise, seed, tokenizer_dir)
    click.echo(f"upcycled {from_dir} into {run}: {meta['base']['family']}, {experts} experts, top-{top_k}")


@click.command("plan")
@click.argument("run", envvar="PATHS_RUN", required=False)
@click.option("--levels", type=int, help="Show this number of levels instead of the run's plan.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True), help="A published MoE config.json instead of a run (no weights): the plan and the memory to train one path.")
@click.option("--micro-batch", default=1, show_default=True, help="--config: sequences per micro-batch, for the activation estimate.")
@click.option("--seq-len", default=2048, show_default=True, help="--config: tokens per sequence, for the activation estimate.")
@click.option("--lora-rank", default=16, show_default=True, help="--config: the adapter rank of the LoRA rows.")
@click.option("--devices", default=8, show_default=True, help="--config: the devices of the FSDP row (its memory is one device's).")
@click.option("--device-memory", type=float, metavar="GIB", help="--config: name the first mode, from a full fine-tune down, that fits this much memory on one device.")
@click.option("--json", "as_json_", is_flag=True)
@click.pass_context
def plan(ctx: click.Context, run: str | None, levels: int | None, config_file: str | None, micro_batch: int, seq_len: int, lora_rank: int, devices: int, device_memory: float | None, as_json_: bool) -> None:
    """Levels, layers per level, number of paths and parameters per path (of a run, or of a config)."""
    from paths.errors import ConfigurationError
    from paths.prepare.decompose import describe, describe_config
    from storage.layout import open_run

    if config_file and ctx.get_parameter_source("run") == click.core.ParameterSource.ENVIRONMENT:
        run = None  # PATHS_RUN exported for the other commands: --config says which model
    if (run is None) == (config_file is None):
        raise ConfigurationError("paths plan takes a RUN or --config FILE (a config.json), one of them")
    summary = describe_config(config_file, levels or 1, micro_batch, seq_len, lora_rank, device_memory, devices) if config_file else describe(open_run(run), levels)
    click.echo(as_json(summary) if as_json_ else render_plan(summary))


@click.command("decompose")
@run_arg
@click.option("--levels", required=True, type=int, help="Contiguous groups of layers; a path picks one expert per level.")
@click.option("--paths", "select", default="all", show_default=True, help="'all' or ids like p00-01,p03-11.")
@click.option("--materialize", is_flag=True, help="Also write paths/<id>/init/ standalone dense checkpoints.")
def decompose(run: str, levels: int, select: str, materialize: bool) -> None:
    """Cut the base MoE into paths (paths/<id>/path.json; no weights copied)."""
    from paths.prepare.decompose import decompose as do
    from storage.layout import open_run

    out = do(open_run(run), levels, select, materialize)
    click.echo(f"decomposed into {len(out['paths'])} paths ({out['parameters_per_path']:,} parameters each): {_ids(out['paths'])}")


def _ids(ids: list[str]) -> str:
    return ", ".join(ids) if len(ids) <= 8 else ", ".join(ids[:4]) + f", ... , {ids[-1]}"


@click.command("materialize")
@run_arg
@click.option("--path", "path_id", required=True, help="The path id, e.g. p00-01.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Local folder for the dense checkpoint.")
@click.option("--final", is_flag=True, help="The trained path (work/<path>/final/, verified) instead of its cut from base/: e.g. a seed for `paths upcycle`.")
def materialize(run: str, path_id: str, out: str, final: bool) -> None:
    """Write one path as a standalone dense HF checkpoint, reading only its bytes from base/."""
    from paths.models import fetch_final
    from paths.models import materialize as do
    from storage.layout import open_run

    if final:
        provenance = fetch_final(open_run(run), path_id, out)
        click.echo(f"wrote {out}: the trained {path_id} ({provenance.get('mode', '?')}, {provenance.get('steps', '?')} steps)")
        return
    stats = do(open_run(run), path_id, out)
    click.echo(f"wrote {out}: {stats['bytes_written']:,} bytes of tensors, read {stats['tensor_bytes_read']:,} (+{stats['header_bytes_read']:,} header) in {stats['seconds']}s")
