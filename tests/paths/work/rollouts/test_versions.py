"""Policy versions that ship what changed: int8 deltas between full snapshots, rebuilt exactly by a
worker that follows along and by one that arrives late (from the snapshot); adapter versions merged
over a base written once; tampering caught by checksums; pruning keeps what a kept delta needs."""

from __future__ import annotations

import json

import pytest
import torch

from paths.adapters import LoraSpec, adapter_state, attach, merge, target_modules
from paths.errors import DataError
from paths.work.rollouts.policy import PolicyReader, VersionWriter, prune, published_versions, version_key
from paths.work.rollouts.versions import apply_delta, encode_delta, state_digest, weights
from tests.paths.work.conftest import loaded, prompt_run
from tests.paths.work.rollouts.conftest import SALT


def nudge(model: torch.nn.Module, seed: int, scale: float = 1e-3) -> None:
    """An optimizer step's worth of change on every tensor."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def test_encode_then_apply_rebuilds_published_exactly_and_tracks_the_weights():
    torch.manual_seed(0)
    new = {"w": torch.randn(8, 16), "b": torch.randn(8), "same": torch.ones(3, 3)}
    published = {"w": new["w"] + torch.randn(8, 16) * 1e-2, "b": torch.zeros(8), "same": torch.ones(3, 3)}
    worker = {k: v.clone() for k, v in published.items()}
    delta = encode_delta(new, published)
    assert "same" not in delta and "same.q" not in delta and delta["w.q"].dtype == torch.int8  # an unchanged tensor ships nothing
    apply_delta(worker, delta)
    assert all(torch.equal(worker[k], published[k]) for k in new)
    assert torch.equal(published["b"], new["b"]) and (published["w"] - new["w"]).abs().max() <= 1e-2 * 4 / 127  # half a step of the row's scale


def test_deltas_between_snapshots_rebuild_every_version(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    model, _ = loaded(run, tmp_path)
    writer = VersionWriter(run, "p00", SALT, snapshot_every=4)
    follower = PolicyReader(run, "p00", loaded(run, tmp_path)[0])
    records = []
    for v in range(7):
        if v:
            nudge(model, v)
        records.append(writer.publish(v, model))
        assert follower.load(v)["version"] == v
        assert state_digest(weights(follower.model)) == records[-1]["sha256"]
        assert max((a - b).abs().max().item() for a, b in zip(weights(follower.model).values(), weights(model).values())) < 1e-4
    assert [r["kind"] for r in records] == ["full", "delta", "delta", "delta", "full", "delta", "delta"]
    assert [r["snapshot"] for r in records] == [0, 0, 0, 0, 4, 4, 4]
    full = records[0]["bytes"]
    assert all(r["bytes"] <= 0.3 * full for r in records if r["kind"] == "delta"), [r["bytes"] / full for r in records]
    late = PolicyReader(run, "p00", loaded(run, tmp_path)[0])  # handed v6 without v5: rebuilt from the snapshot v4
    assert late.load(6)["version"] == 6 and torch.equal(torch.cat([t.flatten() for t in weights(late.model).values()]), torch.cat([t.flatten() for t in weights(follower.model).values()]))
    assert late.load(2)["version"] == 2  # back to an older chain: from its own snapshot


def test_a_tampered_delta_or_record_is_refused(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    model, _ = loaded(run, tmp_path)
    writer = VersionWriter(run, "p00", SALT, snapshot_every=8)
    for v in range(3):
        nudge(model, v)
        writer.publish(v, model)
    key = f"{version_key(run, 'p00', 2)}/delta.safetensors.zst"
    good = run.store.read(key)
    run.store.write(key, good[:-8] + bytes(8))
    with pytest.raises(DataError, match="does not match its policy.json checksum"):
        PolicyReader(run, "p00", loaded(run, tmp_path)[0]).load(2)
    run.store.write(key, good)
    record_key = f"{version_key(run, 'p00', 2)}/policy.json"
    record = json.loads(run.store.read(record_key))
    run.store.write(record_key, json.dumps({**record, "sha256": "0" * 64}).encode())
    with pytest.raises(DataError, match="rebuilt to other weights than its policy.json names"):
        PolicyReader(run, "p00", loaded(run, tmp_path)[0]).load(2)


def test_pruning_keeps_the_chain_of_a_kept_delta(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    model, _ = loaded(run, tmp_path)
    writer = VersionWriter(run, "p00", SALT, snapshot_every=4)
    for v in range(7):
        nudge(model, v)
        writer.publish(v, model)
    prune(run, "p00", lambda v: v >= 6)
    assert published_versions(run, "p00") == [4, 5, 6]
    assert PolicyReader(run, "p00", loaded(run, tmp_path)[0]).load(6)["version"] == 6


def test_adapter_versions_ship_the_adapter_over_a_base_written_once(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    model, _ = loaded(run, tmp_path)
    spec = LoraSpec(rank=2, alpha=4, targets=("attention",))
    adapted = attach(model, spec, target_modules(model, spec, [], False, "p00"))
    writer = VersionWriter(run, "p00", SALT, snapshot_every=4, lora=spec, make_base=lambda: loaded(run, tmp_path)[0])
    reader = PolicyReader(run, "p00", loaded(run, tmp_path)[0])
    base = weights(loaded(run, tmp_path)[0])
    for v in range(3):
        with torch.no_grad():
            for n, p in adapted.named_parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape) * 0.01)
        record = writer.publish(v, adapted)
        assert record["kind"] == "adapter" and record["bytes"] < 0.2 * sum(t.numel() * 4 for t in base.values())
        assert reader.load(v)["version"] == v
        expected = merge(base, {k: v.bfloat16() for k, v in adapter_state(adapted).items()}, spec.scale)  # shipped in bf16
        assert all(torch.equal(weights(reader.model)[k], expected[k]) for k in base)
    assert len([o for o in run.store.list("policy/p00") if "/base-" in o.key and o.key.endswith("model.safetensors")]) == 1
    record_key = f"{version_key(run, 'p00', 2)}/policy.json"
    good = json.loads(run.store.read(record_key))
    for field, value in (("scale", 3.0), ("base_sha256", "0" * 64), ("file_sha256", "0" * 64)):  # under the same sha256 and nonce
        run.store.write(record_key, json.dumps({**good, field: value}).encode())
        with pytest.raises(DataError, match="other than its sha256 covers"):
            PolicyReader(run, "p00", loaded(run, tmp_path)[0]).load(2)


def test_gc_of_a_finished_adapter_path_keeps_the_base_its_latest_version_names(tmp_path, tokenizer_dir):
    from storage.admin import gc_plan
    from storage.manifest import MANIFEST

    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    spec = LoraSpec(rank=2, alpha=4, targets=("attention",))
    bases = []
    for seed in (1, 2):  # a later stage over other starting weights: another base
        base = loaded(run, tmp_path)[0]
        nudge(base, seed)
        adapted = attach(loaded(run, tmp_path)[0], spec, target_modules(loaded(run, tmp_path)[0], spec, [], False, "p00"))
        record = VersionWriter(run, "p00", SALT, snapshot_every=4, lora=spec, make_base=lambda b=base: b).publish(seed, adapted)
        bases.append(record["base"])
    assert bases[0] != bases[1]
    run.store.write(f"work/p00/final/{MANIFEST}", b"{}")  # the path is finished
    plan = {item.key: item.reason for item in gc_plan(run, 0, 2) if item.key.startswith("policy/")}
    assert plan == {"policy/p00/v00000001": "policy version of a finished path (not the latest)", bases[0]: "adapter base no version of a finished path names"}
