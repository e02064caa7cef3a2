"""`paths init --from` for every family: a checkpoint saved by stock transformers imports and
decomposes; one lacking a tensor its family names, or with an expert tensor whose shape disagrees
with its config, is refused in one line with nothing written."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from paths.base import build_model, load_spec, preset_path
from paths.errors import ConfigurationError
from paths.families import fill, get_family
from paths.prepare.decompose import decompose
from paths.prepare.init import init_run
from storage.layout import open_run
from tests.conftest import PRESETS


def saved(family_name: str, folder: str) -> str:
    model = build_model(load_spec(preset_path(PRESETS[family_name]), "test"), seed=0)
    model.save_pretrained(folder)
    return os.path.join(folder, "model.safetensors")


def test_a_checkpoint_of_the_family_imports_and_decomposes(family_name, tmp_path, tokenizer_dir):
    saved(family_name, str(tmp_path / "hf"))
    init_run(str(tmp_path / "run"), from_dir=str(tmp_path / "hf"), tokenizer_dir=tokenizer_dir)
    run = open_run(str(tmp_path / "run"))
    assert run.read_meta()["base"]["family"] == family_name
    assert decompose(run, 1)["paths"] == ["p00", "p01", "p02", "p03"]


@pytest.mark.parametrize("fault", ["missing", "shape"])
def test_a_checkpoint_that_does_not_match_its_family_is_refused(family_name, tmp_path, tokenizer_dir, fault):
    family = get_family(family_name)
    weights = saved(family_name, str(tmp_path / "hf"))
    tensors = load_file(weights)
    name = family.disk_expert(1, 2, "down") if family.experts_disk else fill(family.experts_memory["down"], 1)  # GPT-OSS: fused on disk
    if fault == "missing":
        del tensors[name]
        message = f"has no tensor {name}, which the {family_name} family names for layer 1"
    else:
        tensors[name] = torch.zeros(*tensors[name].shape[:-1], tensors[name].shape[-1] + 1)
        message = f"tensor {name} has shape .* its config.json gives"
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ConfigurationError, match=message):
        init_run(str(tmp_path / "run"), from_dir=str(tmp_path / "hf"), tokenizer_dir=tokenizer_dir)
    assert not os.path.exists(tmp_path / "run")
