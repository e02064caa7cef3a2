"""Experiment trackers (TensorBoard, W&B, MLflow) through accelerate's tracker API.

The metrics JSON lines under work/<unit>/ stay the source of truth; a tracker gets a copy of
each step's record, so the curves can be watched where people already watch curves. Each tracker
is an optional extra (`pip install 'paths[tensorboard]'`, `[wandb]`, `[mlflow]`); W&B runs offline
unless WANDB_MODE says otherwise, MLflow writes to `<logging_dir>/mlflow.db` (SQLite) unless
MLFLOW_TRACKING_URI says otherwise.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from paths.errors import ConfigurationError

# tracker -> the modules that provide it (any one suffices), the extra that installs it
TRACKERS = {"tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"), "wandb": (("wandb",), "wandb"), "mlflow": (("mlflow",), "mlflow")}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module blocked in sys.modules, or a broken install
        return False


def check_tracker(name: str) -> None:
    """Refuse a tracker that does not exist or is not installed, naming the extra."""
    if name == "none":
        return
    if name not in TRACKERS:
        raise ConfigurationError(f"report_to {name!r} is not a tracker: use none, {', '.join(TRACKERS)} (--report-to NAME)")
    modules, extra = TRACKERS[name]
    if not any(_installed(m) for m in modules):
        raise ConfigurationError(f"--report-to {name}: {modules[0]} is not installed: pip install 'paths[{extra}]'")


def accelerator(precision: str, report_to: str = "none", logging_dir: str = "tracking") -> Any:
    """An Accelerator on CUDA when there is one: bf16 for "auto" there, fp32 on the CPU; logging
    to `report_to` (checked) under `logging_dir`."""
    import torch
    from accelerate import Accelerator

    check_tracker(report_to)
    cuda = torch.cuda.is_available()
    mixed = {"auto": "bf16" if cuda else "no", "bf16": "bf16", "fp32": "no"}[precision]
    if report_to == "none":
        return Accelerator(mixed_precision=mixed, cpu=not cuda)
    os.makedirs(logging_dir, exist_ok=True)
    return Accelerator(mixed_precision=mixed, cpu=not cuda, log_with=report_to, project_dir=logging_dir)
