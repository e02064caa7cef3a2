"""All I/O of a run goes through here: fsspec stores, atomic and conditional writes, manifests,
the run layout and the admin operations of `paths storage`."""

from storage.layout import FORMAT_VERSION, Run, open_run, validate_name
from storage.manifest import ArtifactWriter, read_manifest, read_verified, sha256_hex
from storage.retry import RetryPolicy
from storage.store import ObjectInfo, Store
from storage.url import open_store

__all__ = [
    "FORMAT_VERSION",
    "ArtifactWriter",
    "ObjectInfo",
    "RetryPolicy",
    "Run",
    "Store",
    "open_run",
    "open_store",
    "read_manifest",
    "read_verified",
    "sha256_hex",
    "validate_name",
]
