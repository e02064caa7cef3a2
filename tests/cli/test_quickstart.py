"""`paths quickstart` runs every stage on a local folder, twice (the second reuses the run)."""

from __future__ import annotations

from click.testing import CliRunner

from cli.main import main


def test_quickstart_end_to_end_and_rerun(tmp_path):
    root = str(tmp_path / "qs")
    for _ in range(2):
        result = CliRunner().invoke(main, ["quickstart", "--root", root], catch_exceptions=False)
        assert result.exit_code == 0, result.stderr
        assert "MistralForCausalLM with 188,992 parameters (path.json says 188,992)" in result.stdout
        assert "all checksums match" in result.stdout
    assert "already holds a base model" in result.stdout


def test_flexolmo_scenario_composes_and_opts_out(tmp_path):
    root = str(tmp_path / "flex")
    for _ in range(2):
        result = CliRunner().invoke(main, ["quickstart", "--scenario", "flexolmo", "--root", root], catch_exceptions=False)
        assert result.exit_code == 0, result.stderr
        assert "left out p02: experts [2] removed from every layer (3 left)" in result.stdout
        assert "composed:flexolmo-no-math" in result.stdout and "all checksums match" in result.stdout
    assert "p00 (code): already trained" in result.stdout
