"""FSDP2 over 2 gloo ranks: the sharded path trains like the unsharded one, resumes exactly from
its own checkpoints, and a checkpoint written by 2 ranks resumes on 1 process (and one written by 1
on 2 ranks): the whole state is gathered into the usual safetensors checkpoint; final/ is an
ordinary path; --fsdp on one process is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from paths.errors import ConfigurationError
from paths.train_config import load_config
from paths.trainer import _resharded
from paths.work.train import train
from tests.paths.work.test_train import ROOT, final_weights, lm_run

WORKER = os.path.join(ROOT, "tests", "paths", "fsdp_worker.py")


def ranks(run, path: str, n: int, steps: int, batch: int, fsdp: bool, *sets: str) -> list[dict]:
    """Run `n` ranks of the worker; their JSON summaries."""
    port = str(20000 + (os.getpid() * 7 + steps * 31 + n) % 20000)
    env = {**os.environ, "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, WORKER, run.url, path, str(steps), str(batch), "1" if fsdp else "0", *sets], cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    out = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * n, [e[-2000:] for _, e in out]
    return [json.loads(o.strip().splitlines()[-1]) for o, _ in out if o.strip()]


def close(a: dict, b: dict, tol: float) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=tol, rtol=0) for k in a)


@pytest.mark.slow
def test_fsdp_bf16_computes_in_bf16_over_fp32_weights(tmp_path, tokenizer_dir):
    fp32, bf16 = (lm_run(str(tmp_path / n), tokenizer_dir) for n in ("fp32", "bf16"))
    ranks(fp32, "p01-01", 2, 2, 4, True)
    ranks(bf16, "p01-01", 2, 2, 4, True, "precision=bf16")
    a, b = final_weights(fp32, "p01-01"), final_weights(bf16, "p01-01")
    assert all(t.dtype == torch.float32 for t in b.values())  # the weights and AdamW stay fp32
    assert not close(a, b, 1e-7) and close(a, b, 5e-3)  # bf16 compute took effect, and trains the same way


@pytest.mark.slow
def test_fsdp_trains_like_ddp_and_resumes_exactly_on_as_many_ranks_and_on_another_number(tmp_path, tokenizer_dir):
    straight, ddp, resumed, one = (lm_run(str(tmp_path / n), tokenizer_dir) for n in ("straight", "ddp", "resumed", "one"))
    ranks(straight, "p01-01", 2, 4, 4, fsdp=True)
    ranks(ddp, "p01-01", 2, 4, 4, fsdp=False)
    assert close(final_weights(straight, "p01-01"), final_weights(ddp, "p01-01"), 1e-5)  # sharding changes where tensors live, not what they learn
    # same number of ranks: killed after checkpoint 2 (its final removed), resumed to 4
    ranks(resumed, "p01-01", 2, 3, 4, fsdp=True)
    resumed.store.delete_prefix(resumed.final("p01-01"))
    assert ranks(resumed, "p01-01", 2, 4, 4, fsdp=True)[0]["resumed_from"] == 2
    a, b = final_weights(straight, "p01-01"), final_weights(resumed, "p01-01")
    assert all(torch.equal(a[k], b[k]) for k in a), max((a[k] - b[k]).abs().max().item() for k in a)
    # another number of ranks: 2 ranks' checkpoint 2 taken up by one process with their global batch
    ranks(one, "p01-01", 2, 3, 4, fsdp=True)
    one.store.delete_prefix(one.final("p01-01"))
    summary = train(one, "p01-01", "lm", "lm", load_config(sets=["seq_len=16", "batch_size=8", "warmup_steps=1", "min_lr_ratio=1.0", "checkpoint_every=2"], steps=4), None, show_progress=False)
    assert summary["resumed_from"] == 2
    assert close(final_weights(one, "p01-01"), a, 1e-5)  # the same windows in the same steps: one process's sums in another order
    # and back: one process's checkpoint 2, sharded over 2 ranks
    single = lm_run(str(tmp_path / "single"), tokenizer_dir)
    train(single, "p01-01", "lm", "lm", load_config(sets=["seq_len=16", "batch_size=8", "warmup_steps=1", "min_lr_ratio=1.0", "checkpoint_every=2"], steps=3), None, show_progress=False)
    single.store.delete_prefix(single.final("p01-01"))
    assert ranks(single, "p01-01", 2, 4, 4, fsdp=True)[0]["resumed_from"] == 2
    assert close(final_weights(single, "p01-01"), a, 1e-5)


def test_fsdp_on_one_process_or_with_an_adapter_is_one_line(tmp_path, tokenizer_dir):
    run = lm_run(str(tmp_path / "r"), tokenizer_dir)
    with pytest.raises(ConfigurationError, match="--fsdp shards a path over several processes"):
        train(run, "p00-00", "lm", "lm", load_config(sets=["seq_len=16", "batch_size=4", "fsdp=true"], steps=2), None, show_progress=False)
    with pytest.raises(ConfigurationError, match="--fsdp shards a full fine-tune"):
        load_config(sets=["fsdp=true", "lora_rank=4"])
    assert not run.store.list("work/p00-00")


def test_another_number_of_ranks_resumes_only_where_the_global_order_splits_exactly():
    state = {"dataset": "lm", "path": "p00", "split": "train", "seq_len": 16, "seed": 0, "shuffle": True, "batch_size": 4, "windows": 7}
    two = lambda position: [{**state, "rank": r, "world_size": 2, "position": position} for r in range(2)]  # noqa: E731
    assert _resharded(two(3), 1, 0, "checkpoint 6")["position"] == 6  # the first 6 windows of epoch 0, read by rank 0 and rank 1 in turn
    with pytest.raises(ConfigurationError, match=r"past an epoch of 7 that 2 ranks do not split evenly: resume on as many ranks as wrote it \(2\)"):
        _resharded(two(5), 1, 0, "checkpoint 10")  # rank 1's epoch is 3 windows, rank 0's 4: they wrapped apart
    with pytest.raises(ConfigurationError, match=r"past an epoch of 7 that 2 ranks do not split evenly: resume on as many ranks as wrote it \(1\)"):
        _resharded({**state, "rank": 0, "world_size": 1, "position": 8}, 2, 0, "checkpoint 8")
    with pytest.raises(ConfigurationError, match="which 2 ranks cannot split evenly"):
        _resharded({**state, "rank": 0, "world_size": 1, "position": 5}, 2, 0, "checkpoint 5")
    assert _resharded([{**state, "windows": 8, "rank": r, "world_size": 2, "position": 6} for r in range(2)], 4, 3, "checkpoint 12")["position"] == 3  # 8 windows split by 2 and by 4
