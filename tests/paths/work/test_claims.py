"""Claims through the store alone: N racing workers get N distinct paths, the rest exit 3;
expired leases are taken over with a higher generation and the old holder is fenced."""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import time

import pytest
from click.testing import CliRunner

from cli.main import main
from paths.work.claims import claim, read_claim
from paths.errors import LeaseLost, NothingToClaim
from tests.paths.claim_worker import claim_cli


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_twelve_workers_race_for_eight_paths(kind, tmp_path, tokenizer_dir, request):
    env: dict[str, str] = {}
    if kind == "local":
        url, options = str(tmp_path / "run"), None
    else:
        server, bucket = request.getfixturevalue("seaweed"), request.getfixturevalue("bucket")
        url, options, env = f"s3://{bucket}/claims-{tmp_path.name}", server.storage_options, server.env()
    from paths.prepare.init import init_run
    from paths.prepare.decompose import decompose
    from storage.layout import open_run

    init_run(url, preset="tiny-mixtral", tokenizer_dir=tokenizer_dir, storage_options=options)
    run = open_run(url, options)
    decompose(run, 2, ",".join(f"p0{a}-0{b}" for a in range(2) for b in range(4)))  # 8 paths
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(12), ctx.Queue()
    procs = [ctx.Process(target=claim_cli, args=(url, env, str(tmp_path / f"w{i}"), barrier, results)) for i in range(12)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    won = sorted(out for code, out, _ in outcomes if code == 0)
    assert len(won) == 8 and len(set(won)) == 8, outcomes
    assert sorted(code for code, _, _ in outcomes).count(3) == 4, outcomes
    assert all("nothing to claim" in err for code, _, err in outcomes if code == 3)
    for pid in won:
        record, _ = read_claim(run, pid)
        assert record["state"] == "claimed" and record["generation"] == 1


def test_expired_lease_is_taken_over_and_the_old_holder_is_fenced(run2):
    old = claim(run2, ["p00-00"], ttl=0.3, worker="old")
    with pytest.raises(NothingToClaim):
        claim(run2, ["p00-00"], ttl=60, worker="early")  # still live
    time.sleep(0.5)  # expired, and past the takeover grace (at most a quarter of the ttl)
    new = claim(run2, ["p00-00"], ttl=60, worker="new")
    assert new.generation == 2 and new.record["previous"]["worker"] == "old"
    with pytest.raises(LeaseLost, match="p00-00"):
        old.renew()
    with pytest.raises(LeaseLost):
        old.finish("done")
    new.renew()
    new.finish("done")
    with pytest.raises(NothingToClaim):  # done is never claimed again
        claim(run2, ["p00-00"], ttl=60)


def test_fenced_worker_cannot_commit_a_checkpoint(run2):
    import torch

    from paths import checkpoint

    old = claim(run2, ["p00-01"], ttl=0.2, worker="old")
    time.sleep(0.4)
    claim(run2, ["p00-01"], ttl=60, worker="new")
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(LeaseLost):
        checkpoint.save(run2, "p00-01", 5, model.state_dict(), opt.state_dict(), {"step": 5}, old.renew)
    assert run2.checkpoints("p00-01") == [(5, False)]  # files may be there; never COMMITTED


def test_release_and_status_cli(run2, tmp_path, monkeypatch):
    monkeypatch.setenv("PATHS_HOME", str(tmp_path / "home"))
    runner = CliRunner()
    result = runner.invoke(main, ["claim", run2.url, "--path", "p02-02", "--worker", "w1"])
    assert result.exit_code == 0 and result.stdout.strip() == "p02-02"
    local = json.loads((tmp_path / "home" / "claim.json").read_text())
    assert local["path"] == "p02-02" and local["worker"] == "w1"
    result = runner.invoke(main, ["status", run2.url, "--json"])
    rows = {r["path"]: r for r in json.loads(result.stdout)}
    assert rows["p02-02"]["state"] == "claimed" and rows["p02-02"]["worker"] == "w1" and rows["p02-02"]["lease_left_s"] > 500
    assert rows["p00-00"]["state"] == "unclaimed" and len(rows) == 16
    result = runner.invoke(main, ["release", run2.url, "--path", "p02-02", "--state", "failed"])
    assert result.exit_code == 0
    record, _ = read_claim(run2, "p02-02")
    assert record["state"] == "failed" and record["released_by"]
    result = runner.invoke(main, ["claim", run2.url, "--path", "p02-02"])
    assert result.exit_code == 3 and "nothing to claim" in result.stderr
    result = runner.invoke(main, ["storage", "claims", run2.url])
    assert "p02-02" in result.stdout and "failed" in result.stdout
    result = runner.invoke(main, ["storage", "release", run2.url, "--path", "p02-02"])
    assert result.exit_code == 0 and read_claim(run2, "p02-02")[0]["state"] == "open"
    assert claim(run2, ["p02-02"], ttl=5).generation == 2


@pytest.mark.parametrize("paths", [["p00-00"], ["p00-00", "p00-01", "p01-00"]])
def test_a_refused_guess_that_was_our_own_put_is_claimed(run2, paths):
    """A guess's 412 is not read back at once; when the HTTP client resent our put by itself (the
    first copy landed, the resend was refused), the record read later is this guess's, and the
    claim is ours: a lease on it, not "held by a live lease"."""
    from paths.errors import PreconditionFailed

    real, calls = run2.store.put_if_absent, []

    def resent(key, data, **kw):  # on the free path: the put lands, then its resend answers 412 (read back unless confirm=False)
        calls.append(key)
        if key == run2.claim(paths[0]) and calls.count(key) == 1 and kw.get("confirm") is False:
            real(key, data)
            raise PreconditionFailed(f"{key} already exists")
        return real(key, data, **kw)

    for p in paths[1:]:  # the other paths held by live leases
        claim(run2, [p], ttl=600, worker="other")
    run2.store.put_if_absent = resent
    lease = claim(run2, paths, ttl=600, worker="me", rng=random.Random(6))  # 3 paths: a held one guessed first, then the free one
    assert lease.path == paths[0] and lease.worker == "me" and lease.generation == 1
    assert calls[-1] == run2.claim(paths[0]) and calls.count(calls[-1]) == 1  # claimed by reading its record, no second put
    record, etag = read_claim(run2, lease.path)
    assert record["worker"] == "me" and etag == lease.etag
    lease.renew()  # and it is really held: the etag is the record's


def _racing(run2, resend_after_listing: bool):
    """put_if_absent as it goes near a run's end: a racer creates every path this claim guesses
    before its listing, and the first path it tries after the listing (or, `resend_after_listing`,
    that put lands and the HTTP client's resend of it answers 412). Records each put's confirm."""
    from paths.errors import PreconditionFailed

    real_put, real_list, seen = run2.store.put_if_absent, run2.store.list, {"listed": False, "confirm": [], "reads": 0}

    def put(key, data, **kw):
        seen["confirm"].append(kw.get("confirm", True))
        if not seen["listed"] or len(seen["confirm"]) == 3:
            if resend_after_listing and seen["listed"]:
                real_put(key, data)
            else:
                real_put(key, json.dumps({"path": key, "state": "claimed", "worker": "racer", "generation": 1, "expires_at": time.time() + 600}).encode())
            raise PreconditionFailed(f"{key} already exists")
        return real_put(key, data, **kw)

    def listing(*a, **k):
        seen["listed"] = True
        return real_list(*a, **k)

    def read(*a, _f=run2.store.read_with_etag, **k):
        seen["reads"] += 1
        return _f(*a, **k)

    run2.store.put_if_absent, run2.store.list, run2.store.read_with_etag = put, listing, read
    return seen


def test_a_put_that_loses_a_race_after_the_listing_is_not_read_back(run2):
    """Near a run's end racers list the same few free paths: a lost create-only put goes on to the
    next free path at once (no read back, one round trip saved per lost race)."""
    paths = ["p00-00", "p00-01", "p00-02", "p00-03"]
    seen = _racing(run2, resend_after_listing=False)
    lease = claim(run2, paths, ttl=600, worker="me", rng=random.Random(0))
    assert seen["listed"] and len(seen["confirm"]) == 4 and seen["reads"] == 0
    assert seen["confirm"] == [False] * 4  # no put was read back by the store either
    assert lease.worker == "me" and read_claim(run2, lease.path)[0]["worker"] == "me"
    assert sorted(p for p in paths if read_claim(run2, p)[0]["worker"] == "racer") == sorted(set(paths) - {lease.path})


def test_a_put_after_the_listing_whose_resend_was_refused_is_claimed(run2):
    """The one free path after the listing: its put landed and the resend answered 412; the record,
    read once the order comes back to it, is this put's, so the claim is ours."""
    paths = ["p00-00", "p00-01", "p00-02"]
    seen = _racing(run2, resend_after_listing=True)
    lease = claim(run2, paths, ttl=600, worker="me", rng=random.Random(0))
    assert seen["listed"] and len(seen["confirm"]) == 3 and seen["confirm"] == [False] * 3
    assert lease.worker == "me" and lease.generation == 1
    record, etag = read_claim(run2, lease.path)
    assert record["worker"] == "me" and etag == lease.etag
    lease.renew()


@pytest.mark.parametrize("page", [1, 2, 5, 32])
def test_the_paged_listing_sees_every_path_once_from_any_start(run2, monkeypatch, page):
    """_scan from every start, any page size, over a subset of the paths with other paths' records
    between theirs: every path of the subset comes once, free exactly when it has no record."""
    import paths.work.claims as claims_mod

    monkeypatch.setattr(claims_mod, "LIST_PAGE", page)
    everything = [f"p0{a}-0{b}" for a in range(4) for b in range(4)]
    for p in everything[::3]:  # records: some of the subset's, and others' between them
        claim(run2, [p], ttl=600, worker="other")
    subset = everything[1::2]
    for seed in range(12):
        seen = [(p, free) for free_ps, recorded in claims_mod._scan(run2, subset, random.Random(seed)) for p, free in [(x, True) for x in free_ps] + [(x, False) for x in recorded]]
        assert sorted(p for p, _ in seen) == sorted(subset)
        assert all(free == (p not in everything[::3]) for p, free in seen)
