"""The `paths` command: click parsing, one library call per command, printing."""

from __future__ import annotations

import errno
import gc

import click

from paths.errors import PathsError
from storage.errors import no_space


class ErrorsAsOneLine(click.Group):
    """Project errors become `error: ...` on stderr and their exit code; `--debug` shows the trace."""

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except (PathsError, OSError) as exc:
            if ctx.params.get("debug"):
                raise
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:  # a local write outside the store's own (a scratch folder)
                exc = no_space(exc.filename or "the output folder")
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            click.echo(f"error: {message}", err=True)
            ctx.exit(getattr(exc, "exit_code", 1))


@click.group(cls=ErrorsAsOneLine, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.version_option(package_name="paths", prog_name="paths")
def main(debug: bool) -> None:
    """Train mixture-of-experts language models as small dense paths (DiPaCo / HDEE / BTX)."""


def _register() -> None:
    from cli import compose_cmds, data_cmds, expert_cmds, keys_cmds, model_cmds, quickstart, rl_cmds, storage_cmds, work_cmds

    for command in (model_cmds.init, model_cmds.upcycle, model_cmds.plan, model_cmds.decompose, model_cmds.materialize):
        main.add_command(command)
    main.add_command(expert_cmds.expert)
    main.add_command(data_cmds.shard)
    main.add_command(data_cmds.route)
    for command in (work_cmds.claim, work_cmds.train, work_cmds.release, work_cmds.status, work_cmds.gen_tasks):
        main.add_command(command)
    main.add_command(rl_cmds.rejection_sample)
    main.add_command(rl_cmds.rollout)
    main.add_command(keys_cmds.keys)
    main.add_command(compose_cmds.compose)
    main.add_command(compose_cmds.evaluate)
    main.add_command(compose_cmds.next_round)
    main.add_command(compose_cmds.diloco)
    main.add_command(compose_cmds.finetune_moe)
    main.add_command(compose_cmds.report)
    main.add_command(storage_cmds.storage)
    storage_cmds.storage.add_command(work_cmds.release)  # `paths storage release`: the same admin override
    main.add_command(quickstart.quickstart)


_register()


def run() -> None:
    """The `paths` console script (and `python -m cli.main`): the command, then an exit without
    the interpreter's last garbage collections. With torch and transformers loaded they walk
    millions of objects for memory the OS takes back anyway: about 1.1 s of every command's exit
    on a 2-core CPU, paid by each `paths train` / `paths rollout` a worker machine, a test or a
    bench starts, and by the quickstart's parallel lanes (its other stages run in its own process).
    gc.freeze() moves every object to the permanent generation, which those
    collections skip; atexit handlers, weakref finalizers (temporary folders) and whatever
    reference counting frees still run. Only here, where the process ends: a caller of `main`
    in its own process (tests, CliRunner) keeps collecting."""
    try:
        main()
    finally:
        gc.freeze()


if __name__ == "__main__":  # pragma: no cover
    run()
