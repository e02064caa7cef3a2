"""A process that waits at a barrier, then runs `paths claim` (for the race tests)."""

from __future__ import annotations

import os


def claim_cli(url: str, env: dict[str, str], home: str, barrier, results) -> None:
    """Report (exit code, stdout) of one `paths claim` run after the barrier."""
    os.environ.update(env)
    os.environ["PATHS_HOME"] = home
    from click.testing import CliRunner

    from cli.main import main

    runner = CliRunner()
    barrier.wait()
    result = runner.invoke(main, ["claim", url, "--ttl", "60"])
    results.put((result.exit_code, result.stdout.strip(), result.stderr.strip()))
