"""zarr stores over a run's storage (the readers'): the local folder itself, or fsspec (S3,
memory) by URL. sharding/writer.py writes the groups' objects itself."""

from __future__ import annotations

from typing import Any

import zarr.storage

from storage.layout import Run


def storage_options(run: Run) -> dict[str, Any]:
    """The run's storage options, with the S3 endpoint from the environment if set there."""
    from storage.s3 import endpoint_from_env

    options = dict(run.store.options)
    if run.store.protocol in ("s3", "s3a") and "endpoint_url" not in options and endpoint_from_env():
        options["endpoint_url"] = endpoint_from_env()
    return options


def open_zarr_store(run: Run, key: str, read_only: bool):
    """A zarr store rooted at a key of the run."""
    if (path := run.store.local_path(key)) is not None:
        return zarr.storage.LocalStore(path, read_only=read_only)
    return zarr.storage.FsspecStore.from_url(run.store.url_of(key), storage_options=storage_options(run), read_only=read_only)
