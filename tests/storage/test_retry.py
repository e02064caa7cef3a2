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
    """Wraps s3fs's call_s3: the first `n` calls of `method` raise `exc` (optionally after really
    doing the call, as when a response is lost on the way back)."""

    def __init__(self, fs, method: str, n: int, exc: Exception, after_call: bool = False):
        self.real, self.method, self.left, self.exc, self.after = fs.call_s3, method, n, exc, after_call
        self.calls = 0

    def __call__(self, method, *args, **kwargs):
        if method == self.method:
            self.calls += 1
            if self.left > 0:
                self.left -= 1
                if self.after:
                    self.real(method, *args, **kwargs)
                raise self.exc
        return self.real(method, *args, **kwargs)


@pytest.fixture
def s3store(seaweed, bucket):
    import uuid

    return open_store(f"s3://{bucket}/retry-{uuid.uuid4().hex[:8]}", seaweed.storage_options, retry=FAST)


@pytest.mark.parametrize("code,status", [("ServiceUnavailable", 503), ("ConditionalRequestConflict", 409)])
def test_conditional_put_survives_transient_errors(s3store, code, status):
    flaky = Flaky(s3store.fs, "put_object", 2, client_error(code, status))
    s3store.fs.call_s3 = flaky
    etag = s3store.put_if_absent("claims/p0.json", b"mine")
    assert flaky.calls == 3
    assert s3store.read_with_etag("claims/p0.json") == (b"mine", etag)


def test_retries_give_up_with_a_clear_error(s3store):
    s3store.fs.call_s3 = Flaky(s3store.fs, "put_object", 99, client_error("InternalError", 500))
    with pytest.raises(TransientStorageError, match=r"claims/p0.json: still failing after 4 attempts"):
        s3store.put_if_absent("claims/p0.json", b"mine")


def test_lost_response_of_a_winning_create_is_still_a_win(s3store):
    # The PUT lands, the answer is lost; the retry gets 412 against our own object.
    s3store.fs.call_s3 = Flaky(s3store.fs, "put_object", 1, ConnectionResetError(104, "reset"), after_call=True)
    etag = s3store.put_if_absent("claims/p0.json", b"mine")
    assert s3store.read_with_etag("claims/p0.json") == (b"mine", etag)


def test_lost_race_is_not_retried(s3store):
    s3store.put_if_absent("claims/p0.json", b"theirs")
    flaky = Flaky(s3store.fs, "put_object", 0, RuntimeError("unused"))
    s3store.fs.call_s3 = flaky
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
    s3store.fs.call_s3 = Flaky(s3store.fs, "put_object", 1, ConnectionResetError(104, "reset"), after_call=True)
    etag = s3store.put_if_absent("claims/p1.json", b"mine", confirm=False)  # landed, reply lost, retried: 412, read back, ours
    assert s3store.read_with_etag("claims/p1.json") == (b"mine", etag)
