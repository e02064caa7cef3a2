"""`paths quickstart` runs every stage on a local folder, twice (the second reuses the run)."""

from __future__ import annotations

from click.testing import CliRunner
from PIL import Image

from cli.main import main


def test_quickstart_end_to_end_and_rerun(tmp_path):
    root = str(tmp_path / "qs")
    for _ in range(2):
        result = CliRunner().invoke(main, ["quickstart", "--root", root], catch_exceptions=False)
        assert result.exit_code == 0, result.stderr
        assert "MistralForCausalLM with 188,992 parameters (path.json says 188,992)" in result.stdout
        assert "all checksums match" in result.stdout
    assert "already holds a base model" in result.stdout
    assert f"wrote {root}-report/index.html (3 charts: loss.png, routing.png, claims.png)" in result.stdout  # the quickstart ends with its report
    for chart in ("loss", "routing", "claims"):
        with Image.open(f"{root}-report/{chart}.png") as im:
            im.load()


def test_flexolmo_scenario_composes_and_opts_out(tmp_path):
    root = str(tmp_path / "flex")
    for _ in range(2):
        result = CliRunner().invoke(main, ["quickstart", "--scenario", "flexolmo", "--root", root], catch_exceptions=False)
        assert result.exit_code == 0, result.stderr
        assert "left out p02: experts [2] removed from every layer (3 left)" in result.stdout
        assert "composed:flexolmo-no-math" in result.stdout and "all checksums match" in result.stdout
    assert "p00 (code): already trained" in result.stdout


def test_rl_scenario_raises_accuracy_and_the_composed_moe_keeps_it(tmp_path):
    """SFT cold start, upcycle, GRPO per path, compose: held-out math_answer accuracy rises over
    the seed on every path and on the composed MoE (the quickstart prints the table)."""
    import json

    from storage.layout import open_run

    root = str(tmp_path / "rl")
    result = CliRunner().invoke(main, ["quickstart", "--scenario", "rl", "--root", root], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    assert "math_answer accuracy on arith (heldout)" in result.stdout and "all checksums match" in result.stdout
    run = open_run(root)
    table = json.loads(run.store.read(run.store.list("eval/arith")[-1].key))["table"]
    seed = table["base"]["overall"]
    assert 0.1 < seed < 0.9, table  # the cold start solves some, not all
    gains = [table[m]["overall"] - seed for m in ("path:p00", "path:p01")]
    assert min(gains) > 0.05 and sum(gains) / 2 >= 0.10, table  # GRPO raises every path, by 10 points on average
    assert table["composed:rl"]["overall"] - seed >= 0.5 * sum(gains) / 2, table  # the composed MoE keeps most of it
    assert "of the paths' mean gain" in result.stdout
    metrics = [json.loads(x) for x in run.store.read("work/p00/metrics.jsonl").decode().splitlines()]
    solved = [m["reward/math_answer"] for m in metrics]
    assert "heldout_reward" in metrics[9] and sum(solved[-20:]) > sum(solved[:20])  # the sampled completions improve too
    assert f"wrote {root}-report/index.html (3 charts: reward.png, routing.png, claims.png)" in result.stdout
    with Image.open(f"{root}-report/reward.png") as im:
        im.load()


def test_swarm_scenario_trains_two_paths_from_rollout_workers_and_composes(tmp_path, monkeypatch):
    """Two asynchronous trainers and two CPU rollout workers at once, sharing experience through
    the run (SAPO); then compose, the accuracy table and the report. (30 steps: the machinery, in
    half the scenario's time.)"""
    import json

    from cli import scenarios
    from storage.layout import open_run

    monkeypatch.setattr(scenarios, "SWARM_STEPS", 30)
    root = str(tmp_path / "swarm")
    result = CliRunner().invoke(main, ["quickstart", "--scenario", "swarm", "--root", root], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    assert "[trainer p00] trained p00: 30 steps" in result.stdout and "[trainer p01] trained p01: 30 steps" in result.stdout
    assert "[worker p00] wrote" in result.stdout and "as cpu-p00 (signed by" in result.stdout and "math_answer accuracy on arith (heldout)" in result.stdout
    assert "[trainer p00] rollouts: seed-checking" in result.stdout
    run = open_run(root)
    for p in ("p00", "p01"):
        steps = [json.loads(x) for x in run.store.read(f"work/{p}/metrics.jsonl").decode().splitlines()]
        assert sum(m["store_batches"] for m in steps) >= 20  # mostly the worker's batches
        assert sum(m["external_groups"] for m in steps) > 0  # and the other path's experience
        assert sum(m["verified_rows"] for m in steps) > 0
    assert not run.store.list("rollouts/p00/rejected") and not run.store.list("rollouts/p01/rejected")
    assert f"wrote {root}-report/index.html" in result.stdout
