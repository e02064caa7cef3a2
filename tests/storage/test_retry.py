"""Transient faults are retried with backoff; lost races and missing objects are not.

Faults are injected in front of the real SeaweedFS server: the first calls fail as a flaky network
or an overloaded S3 would, then the real call goes through.
"""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from paths.errors import PreconditionFailed, TransientStorageError
from storage.retry import RetryPolicy, is_transient
from storage.url import open_store

FAST = RetryPolicy(attempts=4, base_s=0.001, cap_s=0.01)


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


@pytest.mark.parametrize(
    "exc, transient",
    [
        (client_error("InternalError", 500), True),
        (client_error("SlowDown", 503), True),
        (client_error("ConditionalRequestConflict", 409), True),
        (ConnectionResetError(104, "reset"), True),
        (OSError("wrapped"), False),
        (client_error("PreconditionFailed", 412), False),
        (client_error("NoSuchKey", 404), False),
        (client_error("AccessDenied", 403), False),
    ],
)
def test_transient_classification(exc, transient):
    assert is_transient(exc) is transient


def test_s3fs_wrapped_errors_are_classified_by_their_cause():
    try:
        try:
            raise client_error("ServiceUnavailable", 503)
        except ClientError as inner:
            raise OSError("s3fs translation") from inner
    except OSError as outer:
        assert is_transient(outer)


def test_backoff_windows_grow_and_are_capped():
    policy = RetryPolicy(attempts=8, base_s=0.1, cap_s=1.0)
    delays = list(policy.delays())
    assert len(delays) == 7 and all(0 <= d <= 1.0 for d in delays)


class Flaky:
    """Wraps the store's PUT, on the route the store takes (s3fs's call_s3, or the direct lane of
    storage/s3_direct.py): the first `n` PUTs raise `exc` (optionally after really doing the PUT,
    as when a response is lost on the way back)."""

    def __init__(self, store, n: int, exc: Exception, after_call: bool = False):
        self.lane = store.direct()
        self.owner = self.lane if self.lane is not None else store.fs
        self.name = "put" if self.lane is not None else "call_s3"
        self.real, self.left, self.exc, self.after = getattr(self.owner, self.name), n, exc, after_call
        self.calls = 0
        setattr(self.owner, self.name, self)

    def __call__(self, *args, **kwargs):
        if self.lane is not None or args[0] == "put_object":
            self.calls += 1
            if self.left > 0:
                self.left -= 1
                if self.after:
                    self.real(*args, **kwargs)
                raise self.exc
        return self.real(*args, **kwargs)


@pytest.fixture(params=["direct", "s3fs"])
def s3store(request, seaweed, bucket, monkeypatch):
    """An S3 store on SeaweedFS, its small requests made by the direct lane or by s3fs."""
    import uuid

    monkeypatch.setenv("PATHS_S3_DIRECT", "1" if request.param == "direct" else "0")
    store = open_store(f"s3://{bucket}/retry-{uuid.uuid4().hex[:8]}", seaweed.storage_options, retry=FAST)
    assert (store.direct() is not None) == (request.param == "direct")
    return store


@pytest.mark.parametrize("code,status", [("ServiceUnavailable", 503), ("ConditionalRequestConflict", 409)])
def test_conditional_put_survives_transient_errors(s3store, code, status):
    flaky = Flaky(s3store, 2, client_error(code, status))
    etag = s3store.put_if_absent("claims/p0.json", b"mine")
    assert flaky.calls == 3
    assert s3store.read_with_etag("claims/p0.json") == (b"mine", etag)


def test_retries_give_up_with_a_clear_error(s3store):
    Flaky(s3store, 99, client_error("InternalError", 500))
    with pytest.raises(TransientStorageError, match=r"claims/p0.json: still failing after 4 attempts"):
        s3store.put_if_absent("claims/p0.json", b"mine")


def test_lost_response_of_a_winning_create_is_still_a_win(s3store):
    # The PUT lands, the answer is lost; the retry gets 412 against our own object.
    Flaky(s3store, 1, ConnectionResetError(104, "reset"), after_call=True)
    etag = s3store.put_if_absent("claims/p0.json", b"mine")
    assert s3store.read_with_etag("claims/p0.json") == (b"mine", etag)


def test_lost_race_is_not_retried(s3store):
    s3store.put_if_absent("claims/p0.json", b"theirs")
    flaky = Flaky(s3store, 0, RuntimeError("unused"))
    with pytest.raises(PreconditionFailed):
        s3store.put_if_absent("claims/p0.json", b"mine")
    assert flaky.calls == 1


def test_a_refusal_read_back_only_when_it_may_answer_our_own_write(s3store):
    """confirm=False (claims): a 412 to the only attempt is final, no read; a 412 after a retried
    attempt is still read back, since the first may have landed."""
    s3store.put_if_absent("claims/p0.json", b"theirs")
    reads = []
    real = s3store.read_with_etag
    s3store.read_with_etag = lambda key: reads.append(key) or real(key)
    with pytest.raises(PreconditionFailed):
        s3store.put_if_absent("claims/p0.json", b"mine", confirm=False)
    assert reads == []
    with pytest.raises(PreconditionFailed):
        s3store.put_if_absent("claims/p0.json", b"mine")
    assert reads == ["claims/p0.json"]
    Flaky(s3store, 1, ConnectionResetError(104, "reset"), after_call=True)
    etag = s3store.put_if_absent("claims/p1.json", b"mine", confirm=False)  # landed, reply lost, retried: 412, read back, ours
    assert s3store.read_with_etag("claims/p1.json") == (b"mine", etag)
