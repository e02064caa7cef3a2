"""Retries in one place: exponential backoff with full jitter, for transient store failures only."""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from storage.errors import PathsError

T = TypeVar("T")

# S3 error codes worth another try. 409 ConditionalRequestConflict is AWS telling two conditional
# writers to retry; it is not a lost race (that is 412).
TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestLimitExceeded",
        "ConditionalRequestConflict",
        "OperationAborted",
    }
)


def error_chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, its cause and context, each once (s3fs wraps botocore errors in OSError)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]


def s3_error(exc: BaseException) -> tuple[str | None, int | None]:
    """(error code, HTTP status) of the first botocore ClientError in the chain, if any."""
    for e in error_chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and "Error" in response:
            code = response["Error"].get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status is None and isinstance(code, str) and code.isdigit():
                status = int(code)
            return code, status
    return None, None


def is_transient(exc: BaseException) -> bool:
    """True for failures that another attempt may cure: 5xx, throttling, resets, timeouts."""
    code, status = s3_error(exc)
    if code is not None or status is not None:
        return code in TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429))
    for e in error_chain(exc):
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        # botocore / aiohttp connection errors, matched by name so neither is imported here.
        name = type(e).__name__
        if name in {
            "EndpointConnectionError",
            "ConnectionClosedError",
            "ReadTimeoutError",
            "ConnectTimeoutError",
            "ClientConnectionError",
            "ClientOSError",
            "ServerDisconnectedError",
            "ClientPayloadError",
        }:
            return True
    return False


RETRIES: Counter[str] = Counter()  # retries this process took, by kind of failure (for reports and tests)


def retry_kind(exc: BaseException) -> str:
    """The S3 error code, the HTTP status, or the exception's type: what a retry was for."""
    code, status = s3_error(exc)
    return code or (f"HTTP {status}" if status is not None else type(exc).__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How often and how patiently to retry a transient failure."""

    attempts: int = 6
    base_s: float = 0.1
    cap_s: float = 5.0

    def delays(self) -> Iterator[float]:
        """Sleep before each retry: full jitter over an exponentially growing window."""
        for i in range(self.attempts - 1):
            yield random.uniform(0, min(self.cap_s, self.base_s * 2**i))

    def call(self, fn: Callable[[], T], on_retry: Callable[[BaseException], None] | None = None) -> T:
        """Run fn, retrying transient failures; the last failure is re-raised as it came."""
        delays = self.delays()
        while True:
            try:
                return fn()
            except Exception as exc:
                if isinstance(exc, PathsError) or not is_transient(exc):
                    raise
                delay = next(delays, None)
                if delay is None:
                    raise
                RETRIES[retry_kind(exc)] += 1
                if on_retry is not None:
                    on_retry(exc)
                time.sleep(delay)
