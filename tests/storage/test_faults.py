"""Claim, train with checkpoints, shard and compose through a proxy that faults a share of the
requests to SeaweedFS (500, 503, resets, replies past the client timeout, 409 on conditional PUTs,
lost replies of applied conditional PUTs): all finish, nothing is corrupt, no path is claimed
twice, and a lost-reply conditional write is recognised as the writer's own."""

from __future__ import annotations

import threading

import pytest
import torch

from storage.retry import RETRIES
from tests.storage.fault_proxy import FaultProxy

pytestmark = [pytest.mark.s3, pytest.mark.slow]


@pytest.fixture
def faulty(seaweed):
    proxy = FaultProxy(seaweed.endpoint, share=0.1, seed=7, slow_s=1.5)
    options = {**seaweed.storage_options, "endpoint_url": proxy.url, "config_kwargs": {"read_timeout": 1.0, "connect_timeout": 2}}
    yield proxy, options
    proxy.stop()


def test_claim_shard_train_and_compose_through_injected_faults(faulty, bucket, tokenizer_dir, tmp_path):
    from compose.merge import compose_moe
    from paths.prepare.decompose import decompose
    from paths.prepare.init import init_run
    from paths.train_config import load_config
    from paths.work.claims import claim, read_claim
    from paths.work.train import train
    from sharding.shard import ShardOptions, shard
    from storage.admin import verify
    from storage.layout import open_run
    from tests.sharding.conftest import docs, write_jsonl

    proxy, options = faulty
    RETRIES.clear()
    url = f"s3://{bucket}/faults-{tmp_path.name}"
    proxy.enabled = False  # the base goes in clean; everything after runs through the faults
    init_run(url, preset="tiny-mixtral", tokenizer_dir=tokenizer_dir, seed=1, storage_options=options)
    run = open_run(url, options)
    decompose(run, 1)
    proxy.enabled = True

    shard(run, ShardOptions(dataset="lm", inputs=[write_jsonl(str(tmp_path / "a.jsonl"), docs(240))], id_field="id", holdout=0.0), storage_options=options)

    leases, lock = [], threading.Lock()

    def worker(i: int) -> None:  # 8 workers race for the 4 paths
        try:
            lease = claim(run, ["p00", "p01", "p02", "p03"], ttl=60, worker=f"w{i}")
        except Exception as exc:  # noqa: BLE001 - NothingToClaim for the losers
            lease = exc
        with lock:
            leases.append(lease)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [x for x in leases if not isinstance(x, Exception)]
    assert sorted(x.path for x in won) == ["p00", "p01", "p02", "p03"], leases  # each path once, no double claim
    for lease in won:  # renewals through the faults: a lost reply is recognised as the holder's own write
        for beat in range(8):
            lease.renew(beat=beat)
        record, _ = read_claim(run, lease.path)
        assert record["worker"] == lease.worker and record["generation"] == 1 and record["beat"] == 7

    cfg = load_config(sets=["seq_len=32", "batch_size=4", "warmup_steps=1"], steps=4, checkpoint_every=2)
    for lease in sorted(won, key=lambda x: x.path)[:2]:
        summary = train(run, lease.path, "lm", "lm", cfg, lease, show_progress=False)
        assert summary["steps"] == 4 and read_claim(run, lease.path)[0]["state"] == "done"
        assert [s for s, committed in run.checkpoints(lease.path) if committed] == [2]
    record = compose_moe(run, "through-faults")
    assert sorted(record["paths"]) == ["p00", "p01"]

    proxy.enabled = False
    assert verify(run).ok  # nothing corrupt
    from safetensors.torch import load

    final = load(run.store.read(f"{run.final('p00')}/model.safetensors"))
    assert all(torch.isfinite(t).all() for t in final.values())
    faults = {k: v for k, v in proxy.counts.items() if k not in ("requests", "conditional")}
    share = sum(faults.values()) / proxy.counts["requests"]
    print(f"faults: {proxy.counts['requests']} requests ({proxy.counts['conditional']} conditional PUTs), {sum(faults.values())} faulted ({share:.1%}): {dict(faults)}; retries taken: {dict(RETRIES)}")
    assert faults.get("lost-reply", 0) >= 1 and faults.get("409", 0) >= 1 and faults.get("reset", 0) >= 1 and faults.get("slow", 0) >= 1
    assert sum(RETRIES.values()) > 0  # storage.retry took these; s3fs, aiohttp and zarr retried the rest on their own
