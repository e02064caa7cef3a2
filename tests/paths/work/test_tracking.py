"""--report-to: every step's metrics reach TensorBoard exactly as metrics.jsonl holds them; a
tracker that is not installed is one line naming its extra, before anything is written."""

from __future__ import annotations

import glob
import json
import os
import sys

import pytest
from click.testing import CliRunner

from cli.main import main
from paths.train_config import load_config
from paths.work.train import train
from tests.paths.work.test_train import lm_run


def test_tensorboard_gets_every_step_of_the_metrics(tmp_path, tokenizer_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = lm_run(str(tmp_path / "run"), tokenizer_dir)
    logs = str(tmp_path / "tb")
    cfg = load_config(None, ["seq_len=32", "batch_size=4", "warmup_steps=2"], steps=6, checkpoint_every=3, report_to="tensorboard", logging_dir=logs)
    train(run, "p01-02", "lm", "lm", cfg, None, show_progress=False)

    folders = glob.glob(os.path.join(logs, "run", "p01-02"))
    assert folders, os.listdir(logs)  # <logging_dir>/<run>/<unit>/
    events = EventAccumulator(folders[0])
    events.Reload()
    metrics = [json.loads(line) for line in run.store.read("work/p01-02/metrics.jsonl").decode().splitlines()]
    logged = events.Scalars("loss")
    assert [e.step for e in logged] == [m["step"] for m in metrics] == list(range(1, 7))
    assert [e.value for e in logged] == pytest.approx([m["loss"] for m in metrics], rel=1e-6)
    assert {"lr", "tokens", "tokens_per_s"} <= set(events.Tags()["scalars"])


def test_a_tracker_that_is_not_installed_names_its_extra(tmp_path, tokenizer_dir, monkeypatch):
    run = lm_run(str(tmp_path / "run"), tokenizer_dir)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # how Python blocks a module: importing it fails
    result = CliRunner().invoke(main, ["train", run.url, "--path", "p01-02", "--dataset", "lm", "--steps", "2", "--report-to", "mlflow", "--no-progress"])
    assert result.exit_code == 1
    assert "--report-to mlflow: mlflow is not installed: pip install 'paths[mlflow]'" in result.output
    assert not run.store.exists("work/p01-02/metrics.jsonl") and not os.path.exists(str(tmp_path / "tracking"))
    with pytest.raises(Exception, match="not a tracker"):
        load_config(None, ["report_to=neptune"])
