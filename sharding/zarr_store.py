"""zarr stores over a run's storage: the local folder itself, or fsspec (S3, memory) by URL,
and a wrapper that records the size and sha256 of every object zarr writes (for the manifest)."""

from __future__ import annotations

import asyncio
import hashlib
from typing import TYPE_CHECKING, Any

import zarr.storage

from storage.layout import Run

if TYPE_CHECKING:
    from storage.store import Store


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


class HashingStore(zarr.storage.WrapperStore):
    """Every object written goes through sha256 on its way to the store: {key: entry}."""

    def __init__(self, store: Store, sink: dict[str, dict[str, Any]]):
        super().__init__(store)
        self.sink = sink

    async def set(self, key: str, value: Any) -> None:
        data = value.to_bytes()
        digest = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        await self._store.set(key, value)
        self.sink[key] = {"bytes": len(data), "sha256": digest}
