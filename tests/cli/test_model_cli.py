"""`paths init / plan / decompose / materialize / upcycle` from the command line, and the bad
input each must turn into one line and exit 1."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from cli.main import main


def paths(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def run_dir(tmp_path, tokenizer_dir) -> str:
    url = str(tmp_path / "run")
    code, out, err = paths("init", url, "--preset", "tiny-mixtral", "--tokenizer", tokenizer_dir)
    assert code == 0, err
    return url


def one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    for f in fragments:
        assert f in err, err


def test_init_plan_decompose_materialize(run_dir, tmp_path):
    code, out, _ = paths("plan", run_dir, "--levels", "2")
    assert code == 0 and "paths: 16 (e.g. p00-00)" in out
    code, out, _ = paths("decompose", run_dir, "--levels", "2")
    assert code == 0 and "16 paths" in out
    code, out, _ = paths("plan", run_dir, "--json")
    summary = json.loads(out)
    assert summary["levels"] == 2 and summary["layers_per_level"] == [2, 2] and summary["decomposed"]
    code, out, err = paths("materialize", run_dir, "--path", "p01-02", "--out", str(tmp_path / "p"))
    assert code == 0, err
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "p")).config.model_type == "mistral"


def test_dry_run_writes_nothing(tmp_path):
    code, out, _ = paths("init", str(tmp_path / "r"), "--preset", "dipaco-16x16-150m", "--dry-run")
    assert code == 0 and "16 experts per layer" in out
    per_path = int(out.split("parameters per path: ")[1].split(" ")[0].replace(",", ""))
    assert 140e6 <= per_path <= 160e6
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("levels", ["0", "5"])
def test_levels_out_of_range(run_dir, levels):
    one_line_error(*paths("decompose", run_dir, "--levels", levels)[::2], "--levels must be between 1 and the number of layers (4)")


@pytest.mark.parametrize("bad", ["p1-2", "q00-01", "p00", "p04-00", "p00-01-02", "p00_01"])
def test_bad_path_ids(run_dir, tmp_path, bad):
    paths("decompose", run_dir, "--levels", "2")
    code, _, err = paths("materialize", run_dir, "--path", bad, "--out", str(tmp_path / "o"))
    one_line_error(code, err, bad)
    assert not (tmp_path / "o").exists()


def test_from_an_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300)).save_pretrained(str(tmp_path / "gpt2"))
    code, _, err = paths("init", str(tmp_path / "run"), "--from", str(tmp_path / "gpt2"))
    one_line_error(code, err, "'gpt2'", "mixtral", "qwen3_moe")
    assert not (tmp_path / "run").exists()


def test_init_from_an_existing_moe(run_dir, tmp_path, tokenizer_dir):
    code, out, err = paths("init", str(tmp_path / "copy"), "--from", os.path.join(run_dir, "base"), "--tokenizer", tokenizer_dir)
    assert code == 0, err
    assert paths("decompose", str(tmp_path / "copy"), "--levels", "1")[0] == 0


def test_truncated_base_names_file_and_tensor(run_dir, tmp_path):
    paths("decompose", run_dir, "--levels", "2")
    weights = os.path.join(run_dir, "base", "model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(size - 1000)
    code, _, err = paths("materialize", run_dir, "--path", "p00-00", "--out", str(tmp_path / "o"))
    one_line_error(code, err, "model.safetensors is truncated: tensor ")


def test_mismatching_tensor_is_named(run_dir, tmp_path):
    paths("decompose", run_dir, "--levels", "2")
    weights = os.path.join(run_dir, "base", "model.safetensors")
    from safetensors import safe_open

    with safe_open(weights, "pt") as f:
        name = "model.layers.1.block_sparse_moe.experts.0.w2.weight"
        assert name in f.keys()
    import struct

    with open(weights, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        begin = 8 + n + header[name]["data_offsets"][0]
        f.seek(begin)
        byte = f.read(1)
        f.seek(begin)
        f.write(bytes([byte[0] ^ 0xFF]))
    code, _, err = paths("materialize", run_dir, "--path", "p00-00", "--out", str(tmp_path / "o"))
    one_line_error(code, err, "model.safetensors", name, "sha256")
    assert paths("materialize", run_dir, "--path", "p01-01", "--out", str(tmp_path / "o2"))[0] == 0  # other experts are fine


def test_tokenizer_larger_than_embedding(tmp_path):
    from paths.tokenizer import train_bpe

    train_bpe(700).save_pretrained(str(tmp_path / "tok"))
    code, _, err = paths("init", str(tmp_path / "run"), "--preset", "tiny-mixtral", "--tokenizer", str(tmp_path / "tok"))
    one_line_error(code, err, "700 tokens", "embedding has 512")
    assert not (tmp_path / "run").exists()


def test_unknown_preset_lists_presets(tmp_path):
    code, _, err = paths("init", str(tmp_path / "run"), "--preset", "huge")
    one_line_error(code, err, "unknown preset 'huge'", "tiny-mixtral")


def test_init_refuses_to_overwrite_a_base(run_dir, tokenizer_dir):
    code, _, err = paths("init", run_dir, "--preset", "tiny-qwen3moe", "--tokenizer", tokenizer_dir)
    one_line_error(code, err, "already has a base model")


def test_upcycle_cli(tmp_path, tokenizer_dir):
    from transformers import MistralConfig, MistralForCausalLM

    MistralForCausalLM(MistralConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)).save_pretrained(str(tmp_path / "d"))
    code, out, err = paths("upcycle", str(tmp_path / "run"), "--from", str(tmp_path / "d"), "--experts", "3", "--top-k", "2", "--noise", "0.01", "--tokenizer", tokenizer_dir)
    assert code == 0, err
    code, out, _ = paths("plan", str(tmp_path / "run"), "--json")
    assert json.loads(out)["experts_per_layer"] == 3


def test_plan_of_a_published_config_gives_real_sizes_and_the_memory_of_a_path(tmp_path):
    """Qwen3-30B-A3B without weights: 128 paths of 1.755B parameters (48 layers of shared attention,
    embeddings and head, one 2048x768 expert per layer), and each mode's memory; a config of an
    unsupported family (PhiMoE) is one line naming the supported ones; DeepSeek-V3 (its 3 dense first
    layers shared) and GPT-OSS-20B count the 671B and 20.9B parameters they are published with."""
    from paths.families import CONFIGS

    code, out, err = paths("plan", "--config", os.path.join(CONFIGS, "published", "qwen3-30b-a3b.json"), "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["paths"] == 128 and s["parameters_per_path"] == 1_755_002_880 and s["parameters_total"] == 30_532_122_624
    full = s["memory"]["fp32 AdamW"]
    assert abs(full["weights"] + full["gradients"] + full["optimizer"] - 16 * s["parameters_per_path"] / 2**30) < 1e-6
    assert s["memory"]["bf16 mixed"]["activations"] * 2 == full["activations"]
    code, out, _ = paths("plan", "--config", os.path.join(CONFIGS, "published", "olmoe-1b-7b.json"), "--levels", "2")
    assert code == 0 and "paths: 4096" in out and "path form: moe" in out
    (tmp_path / "phimoe.json").write_text(json.dumps({"model_type": "phimoe", "num_hidden_layers": 32, "num_local_experts": 16}))
    code, _, err = paths("plan", "--config", str(tmp_path / "phimoe.json"))
    one_line_error(code, err, "'phimoe'", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss", "configs/families/<name>.toml")
    code, out, err = paths("plan", "--config", os.path.join(CONFIGS, "published", "gpt-oss-20b.json"), "--json")
    assert code == 0 and json.loads(out)["parameters_total"] == 20_914_757_184, err  # GPT-OSS-20B: 21B as published
    code, out, err = paths("plan", "--config", os.path.join(CONFIGS, "published", "deepseek-v3.json"), "--json")  # 3 dense first layers, shared
    s = json.loads(out)
    assert code == 0 and s["parameters_total"] == 671_026_419_200 and s["paths"] == 256 and s["level_layers"] == [[3, 60]], err
    code, _, err = paths("plan")
    one_line_error(code, err, "a RUN or --config FILE")


def test_plan_names_the_first_mode_that_fits_a_device(tmp_path):
    """Qwen3-30B-A3B on a 24 GiB card: no single-device full fine-tune fits, sharded over 8 devices it
    does; on 12 GiB only an adapter over a 4-bit base; more devices, less a device; adapters' bases
    shrink fp32 > int8 > nf4 while their trainable state is the same; nothing fits 1 GiB."""
    from paths.families import CONFIGS

    config = os.path.join(CONFIGS, "published", "qwen3-30b-a3b.json")

    def plan(*args):
        code, out, err = paths("plan", "--config", config, *args)
        assert code == 0, err
        return out

    s = json.loads(plan("--device-memory", "24", "--json"))
    m = s["memory"]
    assert s["fits"] == "FSDP x8, fp32" and m["fp32 AdamW"]["total"] > 24 and m["bf16 mixed"]["total"] > 24 >= m["FSDP x8, fp32"]["total"]
    assert m["FSDP x8, fp32"]["optimizer"] == m["fp32 AdamW"]["optimizer"] / 8
    assert m["LoRA r16"]["weights"] > m["LoRA r16, int8 base"]["weights"] > m["LoRA r16, nf4 base"]["weights"]
    assert m["LoRA r16"]["optimizer"] == m["LoRA r16, int8 base"]["optimizer"] < m["fp32 AdamW"]["optimizer"] / 50
    assert json.loads(plan("--device-memory", "12", "--json"))["fits"] == "LoRA r16, nf4 base"
    two = json.loads(plan("--devices", "2", "--json"))["memory"]["FSDP x2, fp32"]["total"]
    assert m["FSDP x8, fp32"]["total"] < two < m["fp32 AdamW"]["total"]
    assert "no mode fits" in plan("--device-memory", "1")
    code, _, err = paths("plan", "--config", config, "--devices", "1")
    one_line_error(code, err, "--devices >= 2")


def test_the_console_script_ends_its_process_as_main_would_and_freezes_only_there(run_dir):
    """`paths` (cli.main:run) keeps main's output and exit codes, one-line errors included; the
    objects are frozen out of the exit's garbage collections only where the process ends, never
    in a caller's process."""
    import gc
    import subprocess
    import sys
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert tomllib.load(open(os.path.join(root, "pyproject.toml"), "rb"))["project"]["scripts"]["paths"] == "cli.main:run"
    for args, code, where, text in [(["plan", run_dir, "--levels", "1"], 0, "stdout", "paths: 4"), (["plan", run_dir + "-missing"], 1, "stderr", "error: "),
                                    (["--version"], 0, "stdout", "paths, version")]:
        proc = subprocess.run([sys.executable, "-c", "import gc, sys; from cli.main import run\ntry:\n run()\nfinally:\n print('frozen', gc.get_freeze_count() > 0)", *args],
                              cwd=root, capture_output=True, text=True)
        assert proc.returncode == code and text in getattr(proc, where) and proc.stdout.rstrip().endswith("frozen True"), (args, proc.stdout, proc.stderr)
    before = gc.get_freeze_count()
    assert paths("plan", run_dir, "--levels", "1")[0] == 0 and gc.get_freeze_count() == before
