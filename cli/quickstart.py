"""`paths quickstart`: run the main job on the embedded default and show each stage.

The scenarios are data (cli/scenarios.py): each stage's command line is run through the `paths`
click app itself, so what is printed is what ran, and the worker loop is `paths claim` and
`paths train`, the same commands a worker runs.
"""

from __future__ import annotations

import shlex
import time
from typing import Any

import click

from cli import scenarios, scenarios_envs
from cli.render import render
from paths.errors import PathsError

SCENARIOS = {"main": (scenarios.main_scenario, scenarios.DEFAULT_ROOT), "flexolmo": (scenarios.flexolmo_scenario, scenarios.FLEX_ROOT), "rl": (scenarios.rl_scenario, scenarios.RL_ROOT),
             "swarm": (scenarios.swarm_scenario, scenarios.SWARM_ROOT), "envs": (scenarios_envs.envs_scenario, scenarios_envs.ENVS_ROOT)}
ALL = ("main", "flexolmo", "rl", "swarm", "envs")
NOTHING_TO_CLAIM = 3


@click.command()
@click.option("--scenario", type=click.Choice([*SCENARIOS, "all"]), default="main", show_default=True,
              help="main: decompose, shard, train, compose, eval, HDEE; flexolmo: anchored domain experts and opt-out; rl: SFT cold start, upcycle, GRPO per path, compose; swarm: asynchronous GRPO, trainers and rollout workers sharing experience through the run; envs: a reasoning-gym task and a multi-turn verifiers environment with a tool; all: main, flexolmo, rl, swarm and envs in turn.")
@click.option("--root", help="Folder (or s3:// URL) of the quickstart run (default: runs/quickstart[-SCENARIO]).")
def quickstart(scenario: str, root: str | None) -> None:
    """Create a run on a local folder and walk it through every stage, command by command."""
    start = time.perf_counter()
    for name in ALL if scenario == "all" else [scenario]:
        make, default_root = SCENARIOS[name]
        if scenario == "all":
            click.secho(f"\n=== scenario {name} ===", bold=True)
        suffix = f"-{name}" if scenario == "all" and name != "main" else ""
        walk(make(root + suffix if root else default_root))
    click.echo(f"\nquickstart done in {time.perf_counter() - start:.1f}s")


def walk(scenario: scenarios.Scenario) -> None:
    """Run every stage in order, printing its command line, then what it printed."""
    for stage in scenario.stages:
        click.secho(f"\n$ {scenarios.title(stage)}", bold=True)
        if isinstance(stage, scenarios.Command):
            reason = stage.unless() if stage.unless else None
            if reason:
                click.echo(reason)
                continue
            run_paths(stage.line())
            if stage.note and not stage.note.startswith("("):
                click.echo(f"({stage.note})")
        elif isinstance(stage, scenarios.WorkerLoop):
            trained = 0
            while run_paths(stage.claim, allow=(NOTHING_TO_CLAIM,)) != NOTHING_TO_CLAIM:
                run_paths(stage.train)
                trained += 1
            click.echo("nothing left to claim (exit 3)" if trained else "everything is already trained (nothing to claim: exit 3)")
        elif isinstance(stage, scenarios.ForEach):
            for label, unit in stage.items.items():
                if run_paths(stage.claim(unit), allow=(NOTHING_TO_CLAIM,)) == NOTHING_TO_CLAIM:
                    click.echo(f"{label}: already trained")
                    continue
                run_paths(stage.train)
        elif isinstance(stage, scenarios.Parallel):
            run_parallel(stage)
        else:
            result: Any = stage.fn()
            click.echo(result if isinstance(result, str) else render(result))


def run_parallel(stage: scenarios.Parallel) -> None:
    """Each lane in its own processes (`python -m cli.main ...`, one command after the other, with
    the lane's environment), all lanes at once; then what each printed. A lane whose command
    finds nothing to claim (exit 3) ends there; any other failure stops the quickstart."""
    import os
    import subprocess
    import sys
    import threading

    results: dict[str, list[tuple[list[str], int, str]]] = {}

    def lane(name: str, argvs: list[list[str]]) -> None:
        results[name] = []
        for argv in argvs:
            proc = subprocess.run([sys.executable, "-m", "cli.main", *argv], env={**os.environ, **stage.env.get(name, {})}, capture_output=True, text=True)
            results[name].append((argv, proc.returncode, (proc.stdout + proc.stderr).strip()))
            if proc.returncode:
                return

    threads = [threading.Thread(target=lane, args=item) for item in stage.lanes.items()]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for name in stage.lanes:
        for argv, code, out in results[name]:
            lines = out.splitlines()
            shown = [x for x in lines[:-1] if x.startswith("rollouts: ")] + lines[-1:]  # the summary, and how rollouts were checked
            click.echo("\n".join(f"[{name}] {x}" for x in shown or [""]) if code in (0, NOTHING_TO_CLAIM) else f"[{name}] {out}")
            if code == NOTHING_TO_CLAIM:
                click.echo(f"[{name}] nothing to claim (exit 3): already trained")
            elif code:
                raise PathsError(f"quickstart stopped: `paths {shlex.join(argv)}` ({name}) exited {code}")


def run_paths(argv: list[str], allow: tuple[int, ...] = ()) -> int:
    """`paths ARGV` through the click app in this process (the root of the running command); its
    exit code (0, or one of `allow`), else the quickstart stops with the command named (its own
    error line is printed above)."""
    app = click.get_current_context().find_root().command
    try:
        code = app.main(args=list(argv), prog_name="paths", standalone_mode=False)
    except SystemExit as exc:
        code = exc.code
    code = code if isinstance(code, int) else 0
    if code and code not in allow:
        raise PathsError(f"quickstart stopped: `paths {shlex.join(argv)}` exited {code}")
    return code
