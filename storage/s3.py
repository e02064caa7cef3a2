"""S3 and S3-compatible servers through s3fs: conditional PUTs for claims, bucket handling."""

from __future__ import annotations

import atexit
import os
import weakref
from datetime import datetime
from typing import Any, Callable, TypeVar

from storage.errors import NotFound, PreconditionFailed, StorageError
from storage.retry import RetryPolicy, s3_error
from storage.s3_direct import MAX_BODY, DirectRequests, LaneRefused
from storage.store import Store, is_hidden

T = TypeVar("T")
_PRECONDITION = frozenset({"PreconditionFailed", "412"})
_MISSING = frozenset({"NoSuchKey", "404", "NotFound"})


def endpoint_from_env() -> str | None:
    """The endpoint of an S3-compatible server, as the AWS tools read it from the environment."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def make_s3fs(storage_options: dict[str, Any]):
    """An s3fs filesystem of our own (not fsspec's shared instance), retrying nothing itself:
    retries happen in one place, `storage.retry`."""
    import s3fs

    options = dict(storage_options)
    endpoint = options.pop("endpoint_url", None) or endpoint_from_env()
    if endpoint:
        options["endpoint_url"] = endpoint
    # botocore retries 5xx, throttling and resets by itself unless told not to: one attempt each,
    # so every retry is storage.retry's (jittered, counted, and a lost conditional reply recognised)
    options["config_kwargs"] = {"retries": {"total_max_attempts": 1}, **options.get("config_kwargs", {})}
    # No listing cache: other workers write to the same bucket, so listings must be fresh.
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **options)
    fs.retries = 1
    if fs.session is None:  # ours, kept across s3fs's client refreshes (it re-creates only a session it made)
        fs.session, fs._session_is_owned = _session(fs.kwargs), False
    _OPEN.add(fs)
    return fs


def _session(kwargs: dict[str, Any]) -> Any:
    """The aiobotocore session s3fs would make (its leftover keyword arguments: `profile`, ...),
    whose responses parse ISO 8601 timestamps by `datetime.fromisoformat`: botocore's default
    (dateutil) took two thirds of the client's CPU in a listing (every object's LastModified),
    so a claim's listing of 256 records cost 38 ms of CPU."""
    from aiobotocore.session import AioSession

    session = AioSession(**kwargs)
    session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=_timestamp)
    return session


def _timestamp(value: Any) -> Any:
    """An ISO 8601 timestamp ('2026-12-07T00:32:16.000Z', as S3 lists them) as the datetime
    botocore's parser gives (the same instant and zone); anything else (HTTP dates, epoch seconds,
    and on Python 3.10 a trailing Z) as botocore parses it."""
    if isinstance(value, str) and len(value) > 10 and value[4] == "-" and value[10] == "T":
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            pass
    from botocore.utils import parse_timestamp

    return parse_timestamp(value)


_OPEN: "weakref.WeakSet[Any]" = weakref.WeakSet()


@atexit.register
def close_sessions() -> None:
    """Close the aiohttp sessions of every s3fs filesystem we made (at exit, while fsspec's event
    loop still runs), so nothing warns of an unclosed client session."""
    for fs in list(_OPEN):
        s3 = getattr(fs, "_s3", None)
        if s3 is not None:
            try:
                type(fs).close_session(fs.loop, s3)
            except Exception:  # noqa: BLE001 - shutting down: a session already gone is fine
                pass
            fs._s3 = None
    _OPEN.clear()


class S3Store(Store):
    """`s3://bucket/prefix`: conditional writes are S3's If-None-Match / If-Match PUTs."""

    supports_conditional = True

    def __init__(self, fs: Any, bucket: str, prefix: str, url: str, retry: RetryPolicy):
        super().__init__(fs, f"{bucket}/{prefix}".rstrip("/"), url, retry)
        self.bucket = bucket
        self.prefix = prefix.strip("/")

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    # -- bucket ---------------------------------------------------------------------------------
    def bucket_exists(self) -> bool:
        """Whether the bucket is there (HEAD bucket)."""

        def head() -> bool:
            try:
                self.fs.call_s3("head_bucket", Bucket=self.bucket)
                return True
            except Exception as exc:
                code, status = s3_error(exc)
                if code in ("404", "NoSuchBucket", "NotFound") or status == 404:
                    return False
                if isinstance(exc, FileNotFoundError):
                    return False
                raise

        return self._call("", head)

    def create_bucket(self) -> None:
        """Create the bucket (no-op if it exists)."""
        if not self.bucket_exists():
            self._call("", lambda: self.fs.mkdir(self.bucket))

    def require_bucket(self) -> None:
        """Raise a clear error naming the bucket and the fix when it does not exist."""
        if not self.bucket_exists():
            raise NotFound(
                f"bucket {self.bucket!r} does not exist"
                f"{' at ' + self.fs.endpoint_url if self.fs.endpoint_url else ''}: "
                f"create it with `paths storage init {self.url}`"
            )

    # -- conditional writes ---------------------------------------------------------------------
    def direct(self) -> DirectRequests | None:
        """The lane for this bucket's small requests (storage/s3_direct.py), or None: s3fs's."""
        return DirectRequests.of(self.fs, self.bucket)

    def _small(self, direct: Callable[[DirectRequests], T], through_s3fs: Callable[[], T], body: int = 0) -> T:
        """A small request by the direct lane, or through s3fs where there is none, it just turned
        itself off (LaneRefused: this store answered it otherwise than s3fs), or `body` bytes are
        more than it sends (MAX_BODY)."""
        if body <= MAX_BODY and (lane := self.direct()) is not None:
            try:
                return direct(lane)
            except LaneRefused:
                pass
        return through_s3fs()

    def _put(self, key: str, data: bytes, **condition: str) -> str:
        self._check_writable(key)
        try:
            headers = {"If-None-Match": condition["IfNoneMatch"]} if "IfNoneMatch" in condition else {"If-Match": condition["IfMatch"]}
            return self._small(
                lambda lane: lane.put(self._key(key), data, headers),
                lambda: self.fs.call_s3("put_object", Bucket=self.bucket, Key=self._key(key), Body=data, **condition)["ETag"],
                len(data),
            )
        except Exception as exc:
            code, status = s3_error(exc)
            if code in _PRECONDITION or status == 412 or isinstance(exc, FileExistsError):
                what = "already exists" if "IfNoneMatch" in condition else "changed since it was read"
                raise PreconditionFailed(f"{self.url_of(key)} {what}") from None
            if "IfMatch" in condition and (code in _MISSING or status == 404):
                raise PreconditionFailed(f"{self.url_of(key)} no longer exists") from None
            raise

    def put_if_absent(self, key: str, data: bytes, *, confirm: bool = True) -> str:
        """PUT with If-None-Match: * — exactly one concurrent creator wins."""
        return self._conditional(key, data, lambda: self._put(key, data, IfNoneMatch="*"), confirm)

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        """PUT with If-Match: etag — fails once anyone else has written the object."""
        return self._conditional(key, data, lambda: self._put(key, data, IfMatch=etag))

    def list_page(self, prefix: str, after: str = "", limit: int = 1000) -> tuple[list[str], str | None]:
        """One ListObjectsV2 request: at most `limit` keys (S3 caps it at 1000) after `after`."""
        start = {"StartAfter": self._key(after)} if after else {}
        full = self._key(prefix.rstrip("/")) + "/"

        def through_s3fs() -> tuple[list[str], bool]:
            reply = self.fs.call_s3("list_objects_v2", Bucket=self.bucket, Prefix=full, MaxKeys=limit, **start)
            return [o["Key"] for o in reply.get("Contents", [])], bool(reply.get("IsTruncated"))

        listed, truncated = self._call(prefix, lambda: self._small(lambda lane: lane.list_page(full, start.get("StartAfter", ""), limit), through_s3fs))
        skip = len(self.prefix) + 1 if self.prefix else 0
        keys = [k[skip:] for k in listed]
        last = keys[-1] if keys and truncated else None
        return [k for k in keys if not is_hidden(k)], last

    def read_with_etag(self, key: str) -> tuple[bytes, str]:
        """GET: the body and the ETag of the same version."""
        from fsspec.asyn import sync

        async def get() -> tuple[bytes, str]:
            resp = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self._key(key))
            body = resp["Body"]
            try:
                data = await body.read()
            finally:
                body.close()
            return data, resp["ETag"]

        return self._call(key, lambda: self._small(lambda lane: lane.get(self._key(key)), lambda: sync(self.fs.loop, get)))


def split_s3_url(url: str) -> tuple[str, str]:
    """('bucket', 'prefix') of s3://bucket/prefix."""
    rest = url.split("://", 1)[1].strip("/")
    bucket, _, prefix = rest.partition("/")
    if len(bucket) < 3:
        raise StorageError(f"{url}: bucket names have at least 3 characters (s3://bucket/prefix)")
    return bucket, prefix
