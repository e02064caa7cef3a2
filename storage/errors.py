"""One exception hierarchy for everything a user or the environment can cause.

Every message names the object involved and, where there is one, the fix. The CLI turns any
`PathsError` into a single `error: ...` line and exit code 1; `assert` is kept for internal
invariants only.
"""

from __future__ import annotations


class PathsError(Exception):
    """Base of every error `paths` raises on purpose."""

    exit_code = 1


class ConfigurationError(PathsError):
    """A bad option, config file, name or argument."""


class StorageError(PathsError):
    """The object store could not do what was asked."""


class NotFound(StorageError):
    """An object or folder that should exist does not."""


class PreconditionFailed(StorageError):
    """A conditional write lost: the object exists (create-only) or its etag moved on (CAS)."""


class UnsupportedOperation(StorageError):
    """The storage protocol cannot do this (e.g. conditional writes on plain HTTP)."""


class TransientStorageError(StorageError):
    """A failure worth retrying (5xx, throttling, reset connection) that outlasted the retries."""


class IntegrityError(StorageError):
    """An object is truncated, or its checksum does not match its manifest."""


class DataError(PathsError):
    """An input record cannot be used: malformed JSON, a missing field, bytes that are not UTF-8."""


class FormatVersionError(PathsError):
    """An artifact was written by a newer or unknown format version."""


class LeaseLost(PathsError):
    """Another worker holds this path now (our lease expired and was taken over, or an admin
    released it): stop and write nothing more."""


class NothingToClaim(PathsError):
    """No path is left to claim (`waiting`: how many wait for a DiLoCo round's outer step, and
    will be claimable once it is computed)."""

    exit_code = 3

    def __init__(self, message: str, waiting: int = 0):
        super().__init__(message)
        self.waiting = waiting


class StillWaiting(NothingToClaim):
    """Nothing to claim yet: paths wait for a DiLoCo round's outer step (exit 75, sysexits'
    "temporary failure": claim again later), where exit 3 means the run has nothing left."""

    exit_code = 75


def no_space(where: str) -> StorageError:
    """ENOSPC, as the one-line error every writer gives."""
    return StorageError(f"no space left on the device of {where}: free space (`paths storage gc RUN --yes` removes stale checkpoints), "
                        "then run the same command again; what was committed before is intact")
