"""Run layout, run.json versions, names, manifests and the admin operations."""

from __future__ import annotations

import json

import pytest

from paths.errors import ConfigurationError, FormatVersionError, IntegrityError, NotFound
from storage import admin
from storage.layout import FORMAT_VERSION, open_run, validate_name
from storage.manifest import ArtifactWriter, read_verified


@pytest.fixture
def run(store_url):
    url, options = store_url
    return open_run(url, options, create=True)


def test_named_locations(run):
    assert run.path_json("p03-11") == "paths/p03-11/path.json"
    assert run.shard("web", "p03-11") == "data/web/p03-11.zarr"
    assert run.checkpoint("p03-11", 120) == "work/p03-11/ckpt-120"
    assert run.claim("p00") == "claims/p00.json"
    assert run.composed("round1") == "composed/round1"
    assert run.read_meta()["format_version"] == FORMAT_VERSION


@pytest.mark.parametrize("bad", ["", "a/b", "..", "a..b", ".hidden", "sp ace", "x\n"])
def test_bad_names_are_refused(bad):
    with pytest.raises(ConfigurationError, match="invalid dataset name"):
        validate_name("dataset", bad)


def test_run_json_from_the_future_is_refused(run, store_url):
    run.store.write("run.json", json.dumps({"format_version": FORMAT_VERSION + 1}).encode())
    with pytest.raises(FormatVersionError, match="newer paths"):
        open_run(*store_url)


def test_unreadable_run_json_is_refused(run, store_url):
    run.store.write("run.json", b"{not json")
    with pytest.raises(IntegrityError, match=r"run\.json is unreadable"):
        open_run(*store_url)


def test_a_folder_without_run_json_is_not_a_run(store, store_url):
    store.write("something", b"x")
    with pytest.raises(NotFound, match="is not a paths run"):
        open_run(*store_url)


def test_manifest_written_last_and_checked_on_read(run):
    w = ArtifactWriter(run.store, "composed/m1")
    w.write("model.safetensors", b"\x00" * 100)
    w.write_json("compose.json", {"paths": ["p0"]})
    assert admin.verify(run).manifests == 0  # not committed yet: no manifest
    w.commit(kind="test")
    assert read_verified(run.store, "composed/m1", "model.safetensors") == b"\x00" * 100
    run.store.write("composed/m1/model.safetensors", b"\x00" * 99)
    with pytest.raises(IntegrityError, match="has 99 bytes, its manifest says 100"):
        read_verified(run.store, "composed/m1", "model.safetensors")


def test_verify_finds_missing_and_corrupt_objects(run):
    w = ArtifactWriter(run.store, "base")
    w.write("a.bin", b"aaaa")
    w.write("b.bin", b"bbbb")
    w.write("c.bin", b"cccc")
    w.commit()
    report = admin.verify(run)
    assert report.ok and report.files == 3
    run.store.write("base/a.bin", b"aaab")  # same size, other bytes
    run.store.delete("base/b.bin")
    report = admin.verify(run)
    assert sorted((p.kind, p.key) for p in report.problems) == [("missing", "base/b.bin"), ("sha256", "base/a.bin")]


def test_du_by_area_and_path(run):
    run.store.write("paths/p00-01/path.json", b"12345")
    run.store.write("work/p00-01/ckpt-5/model.safetensors", b"1234567890")
    run.store.write("data/web/p00-01.zarr/zarr.json", b"123")
    run.store.write("claims/p00-01.json", b"12")
    usage = admin.du(run).as_json()
    assert usage["paths"] == {"p00-01": {"bytes": 20, "objects": 4}}
    assert usage["areas"]["work"] == {"bytes": 10, "objects": 1}


def test_gc_keeps_newest_committed_and_fresh_uncommitted(run):
    for step in (10, 20, 30):
        run.store.write(f"work/p0/ckpt-{step}/model.safetensors", b"x")
        run.store.write(f"work/p0/ckpt-{step}/COMMITTED", b"")
    run.store.write("work/p0/ckpt-40/model.safetensors", b"partial")  # in progress
    run.store.write("work/p0/final/config.json", b"{}")
    assert run.checkpoints("p0") == [(10, True), (20, True), (30, True), (40, False)]
    plan = admin.gc_plan(run, older_than_s=3600, keep=2)
    assert [i.key for i in plan] == ["work/p0/ckpt-10"]
    far_future = 10**12
    plan = admin.gc_plan(run, older_than_s=3600, keep=2, now=far_future)
    assert sorted(i.key for i in plan) == ["work/p0/ckpt-10", "work/p0/ckpt-40"]
    admin.gc_apply(run, plan)
    assert run.checkpoints("p0") == [(20, True), (30, True)]
    assert run.store.exists("work/p0/final/config.json")
    with pytest.raises(ConfigurationError, match="--keep"):
        admin.gc_plan(run, 0, keep=0)


def test_claims_listing(run):
    assert admin.claims(run) == []
    run.store.put_if_absent("claims/p1.json", json.dumps({"state": "claimed", "worker": "w", "expires_at": 1.0, "generation": 1}).encode())
    [record] = admin.claims(run)
    assert record["path"] == "p1" and record["expired"] is True
