"""16 processes race to create one key: exactly one wins, on a local folder and on S3."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from tests.storage.race_worker import race

N = 16


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_exactly_one_of_sixteen_creators_wins(kind, tmp_path, request):
    if kind == "local":
        url, options = str(tmp_path / "run"), None
    else:
        server, bucket = request.getfixturevalue("seaweed"), request.getfixturevalue("bucket")
        url, options = f"s3://{bucket}/race-{tmp_path.name}", server.storage_options
    from storage.url import open_store

    store = open_store(url, options, create=True)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(N), ctx.Queue()
    procs = [ctx.Process(target=race, args=(url, options, "claims/p00.json", i, barrier, results)) for i in range(N)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    winners = [me for me, won, _ in outcomes if won]
    assert len(winners) == 1
    assert store.read("claims/p00.json") == f"worker-{winners[0]}".encode()
