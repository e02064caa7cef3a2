"""Small S3 requests without botocore's request pipeline: claims' conditional PUTs, their reads
and listing pages, signed by botocore's own SigV4 signer with the client's own credentials, at the
URL and region botocore itself resolved, sent on a kept-alive `http.client` connection.

Why: a conditional PUT of a 300-byte claim record cost 2.0-2.8 ms of the client's CPU through
s3fs, aiobotocore and aiohttp (botocore's parameter handling, event hooks and endpoint rules, and
fsspec's hop to its event-loop thread) and costs about 0.5 ms this way, the whole PUT on a local
SeaweedFS 2.2 ms instead of 5.6. Where 16 workers claim at once on a shared CPU, a claim waits for
the CPU of everyone's round trips (bench/train.py, claims: p50 54-70 -> 24-29 ms).

What stays botocore's: the credentials chain (environment, profile, SSO, instance roles, with
their refreshing), the URL, region and signature version (read off a request botocore builds up to
its signing and abandons: nothing is sent), the TLS settings of its session (CA bundle or folder,
client certificate) and the signature itself. Left to s3fs as before (`DirectRequests.of` returns
None): proxies, anonymous access, s3fs's extra request arguments (SSE, ACLs, requester pays),
signatures other than SigV4 (S3 Express, multi-region access points), `PATHS_S3_DIRECT=0`. And
the first answer decides: until one request has succeeded, a refusal of the lane itself (a TLS
failure, any 3xx or 4xx but 404, 409, 412 and 429: a redirect, a rejected signature) turns the
lane off for the filesystem and the request is made again through s3fs, so the lane never makes
a store unusable that s3fs can use. A failure of the network (refused, reset, unreachable, a
garbled reply) is a ConnectionError, retried by storage.retry as botocore's are.
"""

from __future__ import annotations

import http.client
import os
import ssl
import threading
import time
import urllib.parse
import urllib.request
from typing import Any
from xml.etree import ElementTree

IDLE_S = 4.0  # a connection unused this long is replaced before use: servers close idle ones (AWS after ~20 s)
MAX_BODY = 64 * 1024  # larger PUTs (rollout batches) go through s3fs: a server that refuses one early may close the connection mid-body


class LaneRefused(Exception):
    """The lane's first answer showed it cannot talk to this store: s3fs takes over."""


class _Resolved(Exception):
    """Raised by the probe's before-sign hook: the request botocore built, never sent."""


class DirectRequests:
    """Signed small requests to one bucket, one kept-alive connection per thread (and process)."""

    def __init__(self, fs: Any, client: Any, bucket: str, object_base: str, bucket_url: str, signing: tuple[str, str]):
        self.fs, self.bucket = fs, bucket
        self.object_base = object_base  # up to the key: https://bucket.s3.eu-west-1.amazonaws.com/ or http://host:port/bucket/
        self.bucket_url = bucket_url  # the bucket's own URL (listings), without a query
        self.service, self.region = signing
        self.credentials = client._request_signer._credentials
        self.timeout = float(client.meta.config.read_timeout or 60)
        http = client._endpoint.http_session  # TLS as botocore's own session has it: CA bundle or folder, client certificate
        self.verify, self.client_cert = getattr(http, "_verify", True), (getattr(http, "_cert_file", None), getattr(http, "_key_file", None))
        parts = urllib.parse.urlsplit(object_base)
        self.https, self.host = parts.scheme == "https", parts.hostname or ""
        self.port = parts.port or (443 if self.https else 80)
        self.proven = False  # a request answered as the protocol expects (not a refusal of the lane)
        self._local = threading.local()
        self._static: Any = None  # static credentials, frozen once
        self._context: ssl.SSLContext | None = None

    # -- made once per filesystem -----------------------------------------------------------------
    @classmethod
    def of(cls, fs: Any, bucket: str) -> "DirectRequests | None":
        """The lane for `fs` and `bucket`, or None where s3fs must make the requests (see above)."""
        lanes = fs.__dict__.setdefault("_paths_direct", {})  # bucket -> lane, kept with the filesystem
        if bucket not in lanes:
            lanes[bucket] = None
            try:
                lanes[bucket] = cls._make(fs, bucket)
            except Exception:  # noqa: BLE001 - no lane: s3fs makes the requests, and meets whatever failed here itself
                pass
        return lanes[bucket]

    @classmethod
    def _make(cls, fs: Any, bucket: str) -> "DirectRequests | None":
        if os.environ.get("PATHS_S3_DIRECT", "1") == "0":
            return None
        if getattr(fs, "s3_additional_kwargs", None) or getattr(fs, "req_kw", None) or getattr(fs, "anon", False):
            return None  # SSE, ACLs, requester pays, anonymous: s3fs adds what we would not
        from fsspec.asyn import sync

        sync(fs.loop, fs.set_session)
        client = sync(fs.loop, fs.get_s3, bucket)  # the bucket's own client where s3fs keeps one per region
        if client.meta.config.proxies or getattr(client._request_signer, "_credentials", None) is None:
            return None
        probe = "paths-probe/a b+~.json"
        url, signing, version = sync(fs.loop, _resolve, client, "GetObject", {"Bucket": bucket, "Key": probe})
        tail = quote_key(probe)
        if version not in ("s3v4", "v4") or not url.endswith("/" + tail):
            return None
        listing, list_signing, _ = sync(fs.loop, _resolve, client, "ListObjectsV2", {"Bucket": bucket, "Prefix": "paths-probe/", "MaxKeys": 1})
        base = url[: -len(tail)]
        if urllib.parse.urlsplit(base).scheme not in ("http", "https") or _proxied(base) or list_signing != signing:
            return None
        return cls(fs, client, bucket, base, listing.split("?", 1)[0], signing)

    # -- the requests -------------------------------------------------------------------------------
    def put(self, key: str, data: bytes, headers: dict[str, str]) -> str:
        """PUT an object (conditions in `headers`); its ETag."""
        reply, _ = self._request("PUT", self.object_base + quote_key(key), {}, data, headers, "PutObject")
        return reply["etag"]

    def get(self, key: str) -> tuple[bytes, str]:
        """GET an object: (body, ETag)."""
        reply, body = self._request("GET", self.object_base + quote_key(key), {}, b"", {}, "GetObject")
        return body, reply["etag"]

    def list_page(self, prefix: str, after: str, limit: int) -> tuple[list[str], bool]:
        """One ListObjectsV2 page: (keys, truncated), keys decoded as botocore decodes them."""
        query = {"list-type": "2", "prefix": prefix, "max-keys": str(limit), "encoding-type": "url"}
        if after:
            query["start-after"] = after
        _, body = self._request("GET", self.bucket_url, query, b"", {}, "ListObjectsV2")
        root = ElementTree.fromstring(body)
        if root.tag.rsplit("}", 1)[-1] != "ListBucketResult":
            raise ConnectionResetError(f"ListObjectsV2 of {self.bucket} answered with <{root.tag}>, not a listing")
        encoded = (root.findtext("{*}EncodingType") or "").lower() == "url"
        keys = [k.text or "" for k in root.findall("{*}Contents/{*}Key")]
        truncated = (root.findtext("{*}IsTruncated") or "false").lower() == "true"
        return [urllib.parse.unquote_plus(k) for k in keys] if encoded else keys, truncated

    def _request(self, method: str, url: str, query: dict[str, str], data: bytes, headers: dict[str, str], operation: str) -> tuple[dict[str, str], bytes]:
        """The reply's headers (lower-case names) and body; an error reply raised as botocore's
        ClientError, or LaneRefused (see the module's docstring)."""
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        if query:
            url += "?" + urllib.parse.urlencode(sorted(query.items()), quote_via=urllib.parse.quote, safe="~")
        request = AWSRequest(method=method, url=url, data=data, headers={**headers, "Content-Length": str(len(data))} if method == "PUT" else dict(headers))
        S3SigV4Auth(self._frozen(), self.service, self.region).add_auth(request)
        parts = urllib.parse.urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        try:
            status, reply, body = self._send(method, target, data if method == "PUT" else None, dict(request.headers.items()))
        except ssl.SSLError as exc:
            if self.proven:
                raise
            self._off()  # TLS set up otherwise than botocore's session: s3fs's
            raise LaneRefused(f"{operation}: {exc}") from exc
        if status >= 300:
            code, message = _error(body, status)
            if not self.proven and status < 500 and status not in (404, 409, 412, 429):  # a redirect, a refused signature, a bad request
                self._off()
                raise LaneRefused(f"{operation} {status} {code}")
            from botocore.exceptions import ClientError  # as botocore raises it, so storage.retry and Store._call classify it alike

            raise ClientError({"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}, operation)
        self.proven = True
        return reply, body

    def _off(self) -> None:
        """This store answers the lane otherwise than s3fs: s3fs makes every request from now on."""
        self.fs.__dict__["_paths_direct"][self.bucket] = None

    def _frozen(self) -> Any:
        from fsspec.asyn import sync

        creds = self.credentials
        if hasattr(creds, "refresh_needed"):
            return sync(self.fs.loop, creds.get_frozen_credentials)  # refreshed by botocore when near expiry
        if self._static is None:
            self._static = sync(self.fs.loop, creds.get_frozen_credentials)
        return self._static

    def _send(self, method: str, target: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        """One request on this thread's kept-alive connection; a failure of the network as a
        ConnectionError (transient to storage.retry), a certificate's as it came."""
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is not None and (local.pid != os.getpid() or time.monotonic() - local.used > IDLE_S):
            if local.pid == os.getpid():
                conn.close()
            conn = local.conn = None  # a forked child's inherited socket is left to its parent
        reused = conn is not None
        try:
            while True:
                conn = conn or self._connect()
                try:
                    conn.request(method, target, body=body, headers=headers)
                    response = conn.getresponse()
                    break
                except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                    if not reused:
                        raise
                    conn.close()  # the server had closed the kept-alive one: once more on a fresh one, as urllib3 and aiohttp do
                    conn, reused = None, False
            payload = response.read()
        except BaseException as exc:
            if conn is not None:
                conn.close()
            local.conn = None
            if isinstance(exc, (http.client.HTTPException, OSError)) and not isinstance(exc, (ConnectionError, TimeoutError, ssl.SSLError)):
                raise ConnectionResetError(f"{method} {target}: {type(exc).__name__}: {exc}") from exc  # DNS, unreachable, a garbled reply
            raise
        reply = {k.lower(): v for k, v in response.getheaders()}
        if response.will_close:
            conn.close()
            conn = None
        local.conn, local.pid, local.used = conn, os.getpid(), time.monotonic()
        return response.status, reply, payload

    def _connect(self) -> http.client.HTTPConnection:
        if not self.https:
            return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self._tls())

    def _tls(self) -> ssl.SSLContext:
        context = self._context
        if context is None:
            if self.verify is False:
                context = ssl._create_unverified_context()  # noqa: S323 - the user's own verify=False
            else:  # the bundle botocore's session verifies with: the given file or folder, else certifi's
                from botocore.httpsession import get_cert_path

                bundle = get_cert_path(self.verify)
                context = ssl.create_default_context(cafile=None if os.path.isdir(bundle) else bundle, capath=bundle if os.path.isdir(bundle) else None)
            cert, key = self.client_cert
            if cert:
                context.load_cert_chain(cert, key)
            self._context = context
        return context


async def _resolve(client: Any, operation: str, params: dict[str, Any]) -> tuple[str, tuple[str, str], str]:
    """(URL, (signing name, region), signature version) of `operation` as botocore would send it:
    the request is built up to its signing and abandoned there (nothing is sent)."""
    seen: dict[str, Any] = {}
    event = f"before-sign.s3.{operation}"
    marker = quote_key(params["Key"]) if "Key" in params else f"prefix={urllib.parse.quote(params['Prefix'], safe='')}"

    def capture(request: Any, signing_name: str, region_name: str, signature_version: str, **_: Any) -> None:
        if seen or marker not in request.url:  # another thread's request: let it be
            return
        signing = request.context.get("signing", {})
        seen.update(url=request.url, signing=(signing.get("signing_name") or signing_name, signing.get("region") or region_name), version=signature_version)
        raise _Resolved

    client.meta.events.register_first(event, capture)
    try:
        method = {"GetObject": client.get_object, "ListObjectsV2": client.list_objects_v2}[operation]
        await method(**params)
    except _Resolved:
        pass
    finally:
        client.meta.events.unregister(event, capture)
    if not seen:
        raise LaneRefused(f"botocore built no {operation} request to resolve")
    return seen["url"], seen["signing"], str(seen["version"])


def quote_key(key: str) -> str:
    """A key as botocore puts it in a URL path."""
    return urllib.parse.quote(key, safe="/~")


def _proxied(url: str) -> bool:
    """Whether the environment sends requests to `url` through a proxy (HTTP(S)_PROXY, NO_PROXY)."""
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies()
    return bool(proxies.get(parts.scheme)) and not urllib.request.proxy_bypass(parts.hostname or "")


def _error(body: bytes, status: int) -> tuple[str, str]:
    """(code, message) of an S3 error reply; the status where its body says nothing."""
    try:
        root = ElementTree.fromstring(body)
        return root.findtext("Code") or str(status), root.findtext("Message") or ""
    except ElementTree.ParseError:
        return str(status), body[:200].decode("utf-8", "replace")
