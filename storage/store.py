"""Object-store access for a run: one `Store` per root URL, every byte of I/O goes through here.

Keys are '/'-separated paths relative to the root (never pathlib: it breaks `s3://`). Writes that
others read are atomic; `put_if_absent` / `put_if_match` give create-only and compare-and-swap
writes on every backend that can offer them: S3 (If-None-Match / If-Match), local folders
(link(2) of a finished temp file, and a flock'd lock file for CAS) and memory:// (a process lock).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterator, TypeVar

import fsspec

from storage.errors import (
    NotFound,
    PathsError,
    PreconditionFailed,
    StorageError,
    TransientStorageError,
    UnsupportedOperation,
    no_space,
)
from storage.retry import RetryPolicy, error_chain, is_transient, s3_error

T = TypeVar("T")

# Names of our own scratch files in local folders; listings hide them.
HIDDEN_PREFIX = ".paths-"
CHUNK = 8 << 20
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_DENIED_CODES = frozenset(
    {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}
)


def _no_credentials(exc: BaseException) -> bool:
    return any(type(e).__name__ == "NoCredentialsError" for e in error_chain(exc))


def content_etag(data: bytes) -> str:
    """The etag of a local or in-memory object: a hash of its content."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One object under a store's root."""

    key: str
    size: int
    mtime: float | None = None


def is_hidden(key: str) -> bool:
    """Whether a key is one of our scratch files, or lies in one of our scratch folders."""
    return any(part.startswith(HIDDEN_PREFIX) for part in key.split("/"))


def check_key(key: str) -> str:
    """A relative '/'-separated key with no empty, '.' or '..' parts."""
    parts = key.split("/")
    if key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise StorageError(f"invalid storage key {key!r}: keys are relative paths without '..'")
    return key


class Store:
    """A root URL on one fsspec filesystem: plain reads and writes, no conditional writes."""

    supports_conditional = False

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str, retry: RetryPolicy):
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")
        self.retry = retry
        self.protocol = url.split("://", 1)[0] if "://" in url else "file"
        self.options: dict[str, Any] = {}  # the storage options the store was opened with
        self.read_only = False  # set on processes that must not write (ranks other than 0)
        self.bytes_read: Counter[str] = Counter()  # by key: what ranged readers really fetched

    def __repr__(self) -> str:
        # Only the URL: storage options may hold credentials.
        return f"{type(self).__name__}({self.url!r})"

    def _check_writable(self, key: str) -> None:
        if self.read_only:
            raise StorageError(f"refusing to write {self.url_of(key)}: this process opened the run read-only (only rank 0 writes to the run)")

    # -- addressing -----------------------------------------------------------------------------
    def path(self, key: str = "") -> str:
        """The filesystem path of a key ('' is the root)."""
        return f"{self.root}/{check_key(key)}" if key else self.root

    def local_path(self, key: str = "") -> str | None:
        """The local file or folder a key is, when the store is a local folder (read it in place:
        memory maps, zarr's LocalStore); None for a remote store (read it through the store)."""
        return None

    def scratch_dir(self, prefix: str) -> str:
        """A fresh private temp folder for files on their way into this store; on a local store
        it sits inside the store (hidden), so `move_in` is a rename, not a copy."""
        import tempfile

        return tempfile.mkdtemp(prefix=f"paths-{prefix}-")

    def url_of(self, key: str = "") -> str:
        """The user-facing URL of a key, for messages."""
        return f"{self.url}/{key}" if key else self.url

    def _rel(self, path: str) -> str:
        path = path.rstrip("/")
        root = self.fs._strip_protocol(self.root).rstrip("/")
        return path[len(root) + 1 :] if path.startswith(root + "/") else path

    def _call(self, key: str, fn: Callable[[], T]) -> T:
        """Run one operation with retries, turning library errors into project errors."""
        try:
            return self.retry.call(fn)
        except PathsError:
            raise
        except FileNotFoundError as exc:
            raise NotFound(f"{self.url_of(key)} does not exist") from exc
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise no_space(self.url_of(key)) from exc
            code, _ = s3_error(exc)
            if code in _MISSING_CODES:
                raise NotFound(f"{self.url_of(key)} does not exist") from exc
            if code == "NoSuchBucket":
                raise NotFound(f"the bucket of {self.url_of(key)} does not exist") from exc
            if code in _DENIED_CODES or isinstance(exc, PermissionError) or _no_credentials(exc):
                raise StorageError(
                    f"access to {self.url_of(key)} was denied ({code or type(exc).__name__}): check "
                    "the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE) "
                    "and the bucket's policy"
                ) from exc
            if is_transient(exc):
                raise TransientStorageError(
                    f"{self.url_of(key)}: still failing after {self.retry.attempts} attempts: {exc}"
                ) from exc
            raise StorageError(f"{self.url_of(key)}: {type(exc).__name__}: {exc}") from exc

    # -- reads ----------------------------------------------------------------------------------
    def read(self, key: str) -> bytes:
        """The whole object."""
        data = self._call(key, lambda: self.fs.cat_file(self.path(key)))
        self.bytes_read[key] += len(data)
        return data

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object; a short read means a truncated object."""
        data = self._call(key, lambda: self.fs.cat_file(self.path(key), start=start, end=end))
        self.bytes_read[key] += len(data)
        if len(data) != end - start:
            raise StorageError(
                f"{self.url_of(key)} is truncated: asked for bytes [{start}, {end}), "
                f"got {len(data)}; rewrite or restore the object"
            )
        return data

    def open(self, key: str) -> IO[bytes]:
        """A binary file object for streaming reads."""
        return self._call(key, lambda: self.fs.open(self.path(key), "rb"))

    def iter_chunks(self, key: str, chunk: int = CHUNK) -> Iterator[bytes]:
        """The object in chunks, for hashing or copying without holding it whole."""
        with self.open(key) as f:
            while block := self._call(key, lambda: f.read(chunk)):
                yield block

    def exists(self, key: str) -> bool:
        """Whether an object (or a folder with objects) is at key."""
        return self._call(key, lambda: self.fs.exists(self.path(key)))

    def size(self, key: str) -> int:
        """Bytes in the object."""
        return self._call(key, lambda: int(self.fs.size(self.path(key))))

    def list(self, prefix: str = "", hidden: bool = False) -> list[ObjectInfo]:
        """Every object under prefix (recursive), sorted by key; our scratch files and staged
        artifacts are left out unless `hidden`."""
        base = self.path(prefix.rstrip("/")) if prefix else self.root

        def find() -> dict:  # a prefix nothing is under lists empty (no existence check first: one round trip, not two)
            try:
                return self.fs.find(base, withdirs=False, detail=True)
            except FileNotFoundError:
                return {}

        out = []
        for path, info in self._call(prefix, find).items():
            if info.get("type") == "directory":  # some S3 servers list empty "folders"
                continue
            key = self._rel(path)
            if not hidden and is_hidden(key):  # temp files and folders
                continue
            out.append(ObjectInfo(key=key, size=int(info.get("size") or 0), mtime=_mtime(info)))
        return sorted(out, key=lambda o: o.key)

    def list_page(self, prefix: str, after: str = "", limit: int = 1000) -> tuple[list[str], str | None]:
        """One page of the keys under prefix in key order: at most `limit` keys greater than
        `after` ('' from the first), and the key to list on after (None: no more). On S3 it is
        one request whose reply, and the time to parse it, grows with `limit`."""
        keys = [o.key for o in self.list(prefix) if o.key > after]
        return keys[:limit], (keys[limit - 1] if len(keys) > limit else None)

    # -- writes ---------------------------------------------------------------------------------
    def write(self, key: str, data: bytes) -> None:
        """Write the object atomically: readers see the old object or the new one, never a part."""
        self._check_writable(key)
        self._call(key, lambda: self.fs.pipe_file(self.path(key), data))

    def upload(self, key: str, local_path: str) -> None:
        """Copy a local file to key atomically (multipart uploads appear only when complete)."""
        self._check_writable(key)
        self._call(key, lambda: self.fs.put_file(local_path, self.path(key)))

    def move_in(self, key: str, local_path: str) -> None:
        """Like upload, and the local file is gone afterwards (a rename when it can be)."""
        self.upload(key, local_path)
        os.remove(local_path)

    def delete(self, key: str) -> None:
        """Remove one object; removing a missing one is not an error (as on S3)."""
        self._check_writable(key)

        def go() -> None:
            try:
                self.fs.rm_file(self.path(key))
            except FileNotFoundError:
                pass  # already gone: deletes are idempotent on every backend

        self._call(key, go)

    def copy(self, src: str, dst: str) -> None:
        """Copy one object to another key (server-side on S3)."""
        self._check_writable(dst)
        self._call(dst, lambda: self.fs.copy(self.path(src), self.path(dst)))

    def replace_prefix(self, staged: str, prefix: str, last: str = "manifest.json") -> None:
        """Put the complete artifact at `staged` in place of whatever is at `prefix`, `last` written
        last. Here (S3, memory): the old `last` goes first (readers then see no artifact rather than
        a mix), each object is copied server-side, objects of the old artifact that the new one lacks
        are removed, `last` is copied, and `staged` is removed."""
        new = {o.key[len(staged) + 1 :] for o in self.list(staged, hidden=True)}
        old = {o.key[len(prefix) + 1 :] for o in self.list(prefix)}
        self.delete(f"{prefix}/{last}")
        for name in sorted(new - {last}):
            self.copy(f"{staged}/{name}", f"{prefix}/{name}")
        for name in sorted(old - new):
            self.delete(f"{prefix}/{name}")
        self.copy(f"{staged}/{last}", f"{prefix}/{last}")
        self.discard_staged(staged)

    def discard_staged(self, staged: str) -> None:
        """Remove a staged (hidden) artifact, whole or partial."""
        for o in self.list(staged, hidden=True):
            self.delete(o.key)

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under prefix; returns how many there were."""
        self._check_writable(prefix)
        objects = self.list(prefix)
        for o in objects:
            self.delete(o.key)
        return len(objects)

    # -- conditional writes ---------------------------------------------------------------------
    def _no_conditional(self) -> UnsupportedOperation:
        return UnsupportedOperation(
            f"{self.protocol}:// ({self.url}) cannot do conditional writes, which claims need: "
            "use a local folder, s3://bucket/prefix or memory://"
        )

    def read_with_etag(self, key: str) -> tuple[bytes, str]:
        """The object and the etag to pass to `put_if_match`."""
        raise self._no_conditional()

    def put_if_absent(self, key: str, data: bytes, *, confirm: bool = True) -> str:
        """Create the object only if nothing is there; returns its etag, else PreconditionFailed.
        `confirm=False`: where a refusal can be ambiguous (S3, see `_conditional`), a refusal of a
        single attempt is final without reading the object back, one round trip fewer; for a
        caller that can live with not knowing, rarely, of a write of its own (a claim: that record
        expires with its ttl and is taken over; nobody ever writes to it thinking it is theirs)."""
        self._check_writable(key)
        raise self._no_conditional()

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        """Replace the object only if its etag is still `etag`; returns the new etag."""
        self._check_writable(key)
        raise self._no_conditional()

    def _conditional(self, key: str, data: bytes, attempt: Callable[[], str], confirm: bool = True) -> str:
        """Run a conditional write with retries; a 412 may answer our own earlier attempt that the
        server applied but whose reply was lost (retried here, or inside the client library), so
        on a 412 the content decides: exactly our bytes there means the write is ours. Even a 412 to
        the first attempt needs the read: aiohttp resends an idempotent PUT by itself when a kept-
        alive connection drops, so the first attempt may have reached the server twice. Without
        `confirm`, a 412 to the first attempt is taken as it reads (that case aside)."""
        tries = 0

        def counted() -> str:
            nonlocal tries
            tries += 1
            return attempt()

        try:
            return self._call(key, counted)
        except PreconditionFailed as exc:
            if not confirm and tries == 1:
                raise
            refused = exc
        # read outside the except block: a failure of the read must not carry the 412 as its context
        # (a chained 412 would make a timeout of the read look permanent to the retry policy)
        try:
            current, etag = self.read_with_etag(key)
        except NotFound:
            raise refused from None
        if current == data:
            return etag
        raise refused


def _mtime(info: dict) -> float | None:
    value = info.get("mtime", info.get("LastModified", info.get("created")))
    if value is None:
        return None
    return value.timestamp() if hasattr(value, "timestamp") else float(value)


class LocalStore(Store):
    """A local folder: temp file + rename for atomic writes, link(2) for create-only, flock for CAS."""

    supports_conditional = True

    def local_path(self, key: str = "") -> str | None:
        return self.path(key)

    def scratch_dir(self, prefix: str) -> str:
        import tempfile

        os.makedirs(self.root, exist_ok=True)
        return tempfile.mkdtemp(prefix=f"{HIDDEN_PREFIX}{prefix}-", dir=self.root)

    def replace_prefix(self, staged: str, prefix: str, last: str = "manifest.json") -> None:
        """Two renames: the old folder aside (hidden), the staged one into place; then the old one
        is removed. A crash between them leaves both whole, the old one under a hidden name."""
        self._check_writable(prefix)
        src, dst = self.path(staged), self.path(prefix)
        if not os.path.exists(dst):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.rename(src, dst)
            return
        aside = os.path.join(os.path.dirname(dst), f"{HIDDEN_PREFIX}tmp-old-{uuid.uuid4().hex[:12]}-{os.path.basename(dst)}")
        os.rename(dst, aside)
        os.rename(src, dst)
        shutil.rmtree(aside, ignore_errors=True)

    def discard_staged(self, staged: str) -> None:
        shutil.rmtree(self.path(staged), ignore_errors=True)

    def _tmp(self, path: str) -> str:
        head, tail = os.path.split(path)
        return os.path.join(head, f"{HIDDEN_PREFIX}tmp-{uuid.uuid4().hex[:12]}-{tail}")

    def _write_tmp(self, path: str, data: bytes) -> str:
        tmp = self._tmp(path)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                f = open(tmp, "wb")
            except FileNotFoundError:  # gc took the emptied folder away between the two calls
                os.makedirs(os.path.dirname(path), exist_ok=True)
                f = open(tmp, "wb")
            with f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            _remove_quietly(tmp)  # a full disk keeps no half-written temp file
            raise
        return tmp

    def _locked(self, path: str):
        head, tail = os.path.split(path)
        os.makedirs(head, exist_ok=True)
        return _FileLock(os.path.join(head, f"{HIDDEN_PREFIX}lock-{tail}"))

    def copy(self, src: str, dst: str) -> None:
        """Copy one object (atomically, folders created as needed)."""
        self.upload(dst, self.path(src))

    def write(self, key: str, data: bytes) -> None:
        """Write to a temp file in the same folder, fsync, then rename over the target."""
        self._check_writable(key)
        path = self.path(key)

        def go() -> None:
            os.replace(self._write_tmp(path, data), path)

        self._call(key, go)

    def move_in(self, key: str, local_path: str) -> None:
        """Rename the file into place when it is on the same filesystem (fsynced first), else copy."""
        self._check_writable(key)
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.stat(local_path).st_dev != os.stat(os.path.dirname(path)).st_dev:
            super().move_in(key, local_path)
            return
        with open(local_path, "rb+") as f:
            os.fsync(f.fileno())
        self._call(key, lambda: os.replace(local_path, path))

    def upload(self, key: str, local_path: str) -> None:
        """Copy through a temp file in the target folder, then rename."""
        self._check_writable(key)
        import shutil

        path = self.path(key)

        def go() -> None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = self._tmp(path)
            try:
                shutil.copyfile(local_path, tmp)
            except BaseException:
                _remove_quietly(tmp)
                raise
            os.replace(tmp, path)

        self._call(key, go)

    def delete(self, key: str) -> None:
        """Remove under the key's lock so a concurrent compare-and-swap cannot resurrect it."""
        self._check_writable(key)
        path = self.path(key)

        def go() -> None:
            with self._locked(path):
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass  # already gone: deletes are idempotent on every backend

        self._call(key, go)

    def read_with_etag(self, key: str) -> tuple[bytes, str]:
        """Renames are atomic, so one read gives a consistent content and etag."""
        data = self.read(key)
        return data, content_etag(data)

    def put_if_absent(self, key: str, data: bytes, *, confirm: bool = True) -> str:
        """Write a complete temp file, then link(2) it to the key: fails if the key exists (never
        ambiguously: `confirm` changes nothing)."""
        self._check_writable(key)
        path = self.path(key)

        def go() -> str:
            tmp = self._write_tmp(path, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise PreconditionFailed(f"{self.url_of(key)} already exists") from None
            finally:
                os.remove(tmp)
            return content_etag(data)

        return self._call(key, go)

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        """Under the key's lock: compare the current content hash, then rename over it."""
        self._check_writable(key)
        path = self.path(key)

        def go() -> str:
            with self._locked(path):
                try:
                    with open(path, "rb") as f:
                        current = content_etag(f.read())
                except FileNotFoundError:
                    raise PreconditionFailed(f"{self.url_of(key)} no longer exists") from None
                if current != etag:
                    raise PreconditionFailed(f"{self.url_of(key)} changed since it was read")
                os.replace(self._write_tmp(path, data), path)
            return content_etag(data)

        return self._call(key, go)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


class _FileLock:
    """An exclusive flock(2) on a lock file, removed again by its holder: a lock leaves no file
    behind. Whoever takes the lock checks that the path still names the file it locked (the
    holder before it may have unlinked it meanwhile) and otherwise tries again, so two processes
    never both hold a key's lock. The kernel releases the flock if the process dies; a file left
    by a killed holder is collected by `paths storage gc` (`stale_lock`)."""

    def __init__(self, path: str):
        self.path = path
        self.fd = -1

    def __enter__(self) -> "_FileLock":
        import fcntl

        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            except FileNotFoundError:  # gc took the emptied folder away meanwhile
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _names(self.path, fd):
                self.fd = fd
                return self
            os.close(fd)  # unlinked by the holder we waited for: lock the file that is there now

    def __exit__(self, *exc: object) -> None:
        import fcntl

        _remove_quietly(self.path)  # while still holding it: a waiter sees the path gone and retries
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _names(path: str, fd: int) -> bool:
    """Whether `path` still names the open file `fd`."""
    try:
        a, b = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def stale_lock(path: str) -> bool:
    """Remove the lock file `path` if nobody holds its lock (a holder killed before removing it);
    whether it was removed."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # held right now
        if not _names(path, fd):
            return False
        _remove_quietly(path)
        return True
    finally:
        os.close(fd)


class MemoryStore(Store):
    """fsspec's in-process memory filesystem; conditional writes under one process lock."""

    supports_conditional = True
    _lock = threading.Lock()  # memory:// is one namespace per process, so is its lock

    def read_with_etag(self, key: str) -> tuple[bytes, str]:
        """Content and its hash, read under the lock."""
        with self._lock:
            data = self.read(key)
        return data, content_etag(data)

    def put_if_absent(self, key: str, data: bytes, *, confirm: bool = True) -> str:
        """Create under the lock, or PreconditionFailed (never ambiguously: `confirm` changes nothing)."""
        self._check_writable(key)
        with self._lock:
            if self.fs.exists(self.path(key)):
                raise PreconditionFailed(f"{self.url_of(key)} already exists")
            self.write(key, data)
        return content_etag(data)

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        """Compare and swap under the lock."""
        self._check_writable(key)
        with self._lock:
            try:
                current = content_etag(self.read(key))
            except NotFound:
                raise PreconditionFailed(f"{self.url_of(key)} no longer exists") from None
            if current != etag:
                raise PreconditionFailed(f"{self.url_of(key)} changed since it was read")
            self.write(key, data)
        return content_etag(data)

    def delete(self, key: str) -> None:
        """Remove under the lock."""
        self._check_writable(key)
        with self._lock:
            super().delete(key)
