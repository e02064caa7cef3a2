"""The storage contract, run against every backend (local folder, memory://, SeaweedFS S3)."""

from __future__ import annotations

import threading

import pytest

from paths.errors import (
    ConfigurationError,
    NotFound,
    PreconditionFailed,
    StorageError,
    UnsupportedOperation,
)
from storage.store import check_key
from storage.url import open_store


def test_roundtrip_and_listing(store):
    store.write("a/b/c.bin", b"abc")
    store.write("a/d.txt", b"hello world")
    store.write("top.json", b"{}")
    assert store.read("a/b/c.bin") == b"abc"
    assert store.read_range("a/d.txt", 6, 11) == b"world"
    assert store.size("a/d.txt") == 11
    assert store.exists("a/d.txt") and store.exists("a") and not store.exists("nope")
    assert [o.key for o in store.list()] == ["a/b/c.bin", "a/d.txt", "top.json"]
    assert [(o.key, o.size) for o in store.list("a/b")] == [("a/b/c.bin", 3)]
    assert store.list("missing") == []
    assert b"".join(store.iter_chunks("a/d.txt", chunk=4)) == b"hello world"


def test_listing_a_page_at_a_time(store):
    """list_page walks the keys under a prefix in key order, `limit` at a time, from any key on,
    leaving out scratch files; the key to go on after is None at the end."""
    from storage.store import HIDDEN_PREFIX

    keys = [f"claims/p{i:02d}.json" for i in range(7)]
    for k in keys + ["claims-other/x.json", "top.json"]:
        store.write(k, b"{}")
    store.write(f"claims/{HIDDEN_PREFIX}tmp-1", b"scratch")  # a scratch file: never in a page
    got, after, pages = [], "", 0
    while True:
        page, after = store.list_page("claims", after, 3)
        got, pages = got + page, pages + 1
        assert len(page) <= 3
        if after is None:
            break
    assert got == keys and pages == 3
    assert store.list_page("claims", "claims/p02.json", 2) == (["claims/p03.json", "claims/p04.json"], "claims/p04.json")
    assert store.list_page("claims", "claims/p05.json", 10) == (["claims/p06.json"], None)
    assert store.list_page("nothing", "", 10) == ([], None)


def test_overwrite_and_delete(store):
    store.write("k", b"one")
    store.write("k", b"two")
    assert store.read("k") == b"two"
    store.delete("k")
    assert not store.exists("k")
    store.write("p/1", b"x")
    store.write("p/2", b"y")
    assert store.delete_prefix("p") == 2
    assert store.list() == []


def test_missing_object_names_the_url(store):
    with pytest.raises(NotFound, match=r"nope/x\.bin does not exist"):
        store.read("nope/x.bin")
    with pytest.raises(NotFound):
        store.size("nope")
    store.delete("nope")  # idempotent, as S3 is


def test_short_ranged_read_is_an_error(store):
    store.write("short", b"12345")
    with pytest.raises(StorageError, match="truncated"):
        store.read_range("short", 2, 10)


def test_put_if_absent_creates_once(store):
    etag = store.put_if_absent("claims/p00.json", b"first")
    with pytest.raises(PreconditionFailed, match="already exists"):
        store.put_if_absent("claims/p00.json", b"second")
    data, current = store.read_with_etag("claims/p00.json")
    assert data == b"first" and current == etag


def test_put_if_match_is_compare_and_swap(store):
    e1 = store.put_if_absent("lease", b"v1")
    e2 = store.put_if_match("lease", b"v2", e1)
    assert e2 != e1
    assert store.read_with_etag("lease") == (b"v2", e2)
    with pytest.raises(PreconditionFailed):
        store.put_if_match("lease", b"v3", e1)  # stale etag
    assert store.read("lease") == b"v2"
    with pytest.raises(PreconditionFailed):
        store.put_if_match("gone", b"v1", e2)  # no object to compare against


def test_readers_never_see_a_partial_object(store):
    big_a, big_b = b"a" * (3 << 20), b"b" * (3 << 20)
    store.write("obj", big_a)
    seen: set[bytes] = set()
    stop = threading.Event()

    def read_loop() -> None:
        while not stop.is_set():
            data = store.read("obj")
            seen.add(data[:1] + data[-1:] + str(len(data)).encode())

    reader = threading.Thread(target=read_loop)
    reader.start()
    for i in range(6):
        store.write("obj", big_b if i % 2 == 0 else big_a)
    stop.set()
    reader.join()
    n = str(3 << 20).encode()
    assert seen <= {b"aa" + n, b"bb" + n}


@pytest.mark.parametrize("bad", ["../x", "a/../../x", "/abs", "a//b", "", "a/./b"])
def test_keys_cannot_escape_the_root(bad):
    with pytest.raises(StorageError, match="invalid storage key"):
        check_key(bad)


def test_unknown_scheme_is_a_configuration_error():
    with pytest.raises(ConfigurationError, match="unknown URL scheme 'nosuch'"):
        open_store("nosuch://bucket/x")


def test_protocol_without_conditional_writes_says_so():
    store = open_store("http://127.0.0.1:9/run")
    with pytest.raises(UnsupportedOperation, match=r"http:// .* cannot do conditional writes"):
        store.put_if_absent("claims/p0.json", b"{}")


def test_local_folder_must_exist_without_create(tmp_path):
    with pytest.raises(NotFound, match="paths storage init"):
        open_store(str(tmp_path / "absent"))
    assert open_store(str(tmp_path / "absent"), create=True).list() == []
