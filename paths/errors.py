"""The exception hierarchy, re-exported: it lives at the bottom, in `storage.errors`, so the
storage layer imports nothing from above it."""

from storage.errors import (  # noqa: F401
    ConfigurationError,
    DataError,
    FormatVersionError,
    IntegrityError,
    LeaseLost,
    NothingToClaim,
    NotFound,
    PathsError,
    PreconditionFailed,
    StillWaiting,
    StorageError,
    TransientStorageError,
    UnsupportedOperation,
)

__all__ = [
    "PathsError", "ConfigurationError", "StorageError", "NotFound", "PreconditionFailed", "UnsupportedOperation",
    "TransientStorageError", "IntegrityError", "DataError", "FormatVersionError", "LeaseLost", "NothingToClaim", "StillWaiting",
]
