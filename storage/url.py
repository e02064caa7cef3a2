"""Route a URL to its store: local folder (the default), s3://, memory://, other fsspec protocols."""

from __future__ import annotations

import os
from typing import Any

import fsspec

from storage.errors import ConfigurationError, NotFound
from storage.retry import RetryPolicy
from storage.s3 import S3Store, make_s3fs, split_s3_url
from storage.store import LocalStore, MemoryStore, Store


def protocol_of(url: str) -> str:
    """'file' for plain paths, else the scheme before '://'."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def open_store(
    url: str,
    storage_options: dict[str, Any] | None = None,
    *,
    create: bool = False,
    retry: RetryPolicy | None = None,
) -> Store:
    """The store rooted at url. Without `create`, a missing S3 bucket or local folder is an error
    that names it and says how to create it."""
    store = _open(url, storage_options, create, retry)
    store.options = dict(storage_options or {})  # for libraries that open the URL themselves (zarr)
    return store


def _open(url: str, storage_options: dict[str, Any] | None, create: bool, retry: RetryPolicy | None) -> Store:
    if not url:
        raise ConfigurationError("empty run URL: pass a folder, s3://bucket/prefix, or set PATHS_RUN")
    options = dict(storage_options or {})
    retry = retry or RetryPolicy()
    protocol = protocol_of(url)
    if protocol == "file":
        root = os.path.abspath(url.split("://", 1)[-1])
        if os.path.exists(root) and not os.path.isdir(root):
            raise ConfigurationError(f"{root} is a file, not a folder: give a folder for the run")
        if create:
            os.makedirs(root, exist_ok=True)
        elif not os.path.isdir(root):
            raise NotFound(f"no run at {root}: create one with `paths storage init {root}`")
        return LocalStore(fsspec.filesystem("file"), root, root, retry)
    if protocol in ("s3", "s3a"):
        bucket, prefix = split_s3_url(url)
        store = S3Store(make_s3fs(options), bucket, prefix, f"s3://{bucket}/{prefix}".rstrip("/"), retry)
        if create:
            store.create_bucket()
        else:
            store.require_bucket()
        return store
    if protocol == "memory":
        root = "/" + url.split("://", 1)[1].strip("/")
        return MemoryStore(fsspec.filesystem("memory"), root, url, retry)
    if protocol not in fsspec.available_protocols():
        raise ConfigurationError(
            f"unknown URL scheme {protocol!r} in {url}: use a local folder, s3://bucket/prefix "
            "or memory://name"
        )
    try:
        fs = fsspec.filesystem(protocol, **options)
    except ImportError as exc:
        raise ConfigurationError(
            f"{protocol}:// needs a package that is not installed ({exc}); install it, "
            "or use a local folder or s3://"
        ) from exc
    return Store(fs, fs._strip_protocol(url), url, retry)
