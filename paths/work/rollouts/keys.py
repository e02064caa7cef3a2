"""Who may send rollouts: Ed25519 worker keys (the `cryptography` library) and the run's allowlist.

A worker holds a private key file (PEM, PKCS#8, mode 0600; `paths keys new`). The run's owner
admits its public key under a name (`paths keys admit`), which writes workers/allowlist.json by
compare-and-swap, so two admissions at once never lose one. A worker signs every batch; the trainer
reads batches only under admitted, unrevoked names and checks each signature against that name's
key, so writing under a worker's name is not enough to speak for it. `paths keys open` lets
unsigned batches in as well (a run among trusted machines).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from paths.errors import ConfigurationError, NotFound, PreconditionFailed
from storage.layout import Run, validate_name

FORMAT = "paths-allowlist"
KEY_HEX = re.compile(r"[0-9a-f]{64}")


def default_key_file() -> str:
    """$PATHS_HOME/worker.key, else ./.paths/worker.key."""
    home = os.environ.get("PATHS_HOME")
    return os.path.join(home or ".paths", "worker.key")


# -- keys ---------------------------------------------------------------------------------------------
def new_key(out: str, overwrite: bool = False) -> str:
    """Write a new private key to `out` (0600, atomically); its public key as hex."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if os.path.exists(out) and not overwrite:
        raise ConfigurationError(f"{out} already exists: keep it (its public key: `paths keys show --key {out}`), or pass --overwrite to replace it")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    folder = os.path.dirname(os.path.abspath(out))
    tmp = os.path.join(folder, f".{os.path.basename(out)}.tmp-{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        os.replace(tmp, out)
        with open(f"{out}.pub", "w") as f:  # what the worker hands the run's owner, as ssh-keygen does
            f.write(public_hex(key) + "\n")
    except OSError as exc:
        raise ConfigurationError(f"cannot write the key to {out} ({exc.strerror}): pick a writable --out") from None
    return public_hex(key)


def load_key(path: str) -> Any:
    """The Ed25519 private key in `path`, or a one-line error saying why it cannot be used."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigurationError(f"cannot read worker key {path} ({exc.strerror}): create one with `paths keys new --out {path}`, or pass --key FILE") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"{path} is not an unencrypted PEM private key ({str(exc)[:60]}): create one with `paths keys new --out {path}`") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigurationError(f"{path} holds a {type(key).__name__}, not an Ed25519 key: create one with `paths keys new --out {path}`")
    return key


def public_hex(key: Any) -> str:
    """The raw 32-byte public key of a private key, as 64 hex digits."""
    from cryptography.hazmat.primitives import serialization

    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def check_public(text: str, where: str) -> str:
    """A public key given as 64 hex digits (what `paths keys new` prints), or the path of a file
    holding them (its FILE.pub), normalised."""
    value = text.strip().lower()
    if not KEY_HEX.fullmatch(value) and os.path.isfile(text):
        with open(text) as f:
            value = f.read(200).strip().lower()
    if not KEY_HEX.fullmatch(value):
        raise ConfigurationError(f"{where}: {text[:80]!r} is not an Ed25519 public key (64 hex digits, as `paths keys new` or `paths keys show` print it)")
    return value


def sign(key: Any, message: bytes) -> str:
    return key.sign(message).hex()


def verify(public: str, message: bytes, signature: Any) -> bool:
    """Whether `signature` (hex) is `public`'s signature of `message`."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if not isinstance(signature, str) or not re.fullmatch(r"[0-9a-f]{128}", signature):
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public)).verify(bytes.fromhex(signature), message)
    except (InvalidSignature, ValueError):
        return False
    return True


# -- the allowlist ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Worker:
    """An admitted worker: its name (the folder its batches go to) and public key."""

    name: str
    key: str
    admitted_at: float
    revoked_at: float | None = None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


@dataclass(slots=True)
class Allowlist:
    """workers/allowlist.json: who may send rollout batches, and whether unsigned ones are let in."""

    open: bool = False
    workers: dict[str, Worker] = field(default_factory=dict)

    def by_key(self, key: str) -> Worker | None:
        return next((w for w in self.workers.values() if w.key == key), None)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": 1, "open": self.open,
                "workers": {n: {"key": w.key, "admitted_at": w.admitted_at, "revoked_at": w.revoked_at} for n, w in sorted(self.workers.items())}}

    @staticmethod
    def from_json(raw: bytes, where: str) -> "Allowlist":
        """Parse and check every field; a ConfigurationError naming what is wrong otherwise."""
        fix = "restore it, or rewrite it with `paths keys admit` / `paths keys revoke`"
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ConfigurationError(f"{where} is not JSON ({exc}): {fix}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != 1:
            raise ConfigurationError(f"{where} is not a version-1 {FORMAT}: {fix}")
        if not isinstance(data.get("open"), bool) or not isinstance(data.get("workers"), dict):
            raise ConfigurationError(f"{where}: 'open' must be true or false and 'workers' an object: {fix}")
        workers, seen = {}, {}
        for name, w in data["workers"].items():
            try:
                validate_name("worker", name)
            except ConfigurationError as exc:
                raise ConfigurationError(f"{where}: {exc}: {fix}") from None
            if not isinstance(w, dict) or not isinstance(w.get("key"), str):
                raise ConfigurationError(f"{where}: worker {name!r} has no key: {fix}")
            key = check_public(w["key"], f"{where}: worker {name!r}")
            if key in seen:
                raise ConfigurationError(f"{where}: workers {seen[key]!r} and {name!r} share one key: revoke one of them")
            stamps = (w.get("admitted_at"), w.get("revoked_at"))
            if not isinstance(stamps[0], (int, float)) or not (stamps[1] is None or isinstance(stamps[1], (int, float))):
                raise ConfigurationError(f"{where}: worker {name!r} has malformed admitted_at / revoked_at times: {fix}")
            seen[key] = name
            workers[name] = Worker(name, key, float(stamps[0]), None if stamps[1] is None else float(stamps[1]))
        return Allowlist(data["open"], workers)


def read_allowlist(run: Run) -> Allowlist:
    """The run's allowlist; a run without one is closed, with nobody admitted."""
    try:
        raw = run.store.read(run.allowlist())
    except NotFound:
        return Allowlist()
    return Allowlist.from_json(raw, run.store.url_of(run.allowlist()))


def _update(run: Run, change: Callable[[Allowlist], Allowlist]) -> Allowlist:
    """Read, change, write back only if nobody wrote in between (else read again)."""
    key = run.allowlist()
    for _ in range(20):
        try:
            raw, etag = run.store.read_with_etag(key)
            current = Allowlist.from_json(raw, run.store.url_of(key))
        except NotFound:
            raw, etag, current = None, None, Allowlist()
        new = change(current)
        data = json.dumps(new.to_json(), indent=2, sort_keys=True).encode() + b"\n"
        try:
            if etag is None:
                run.store.put_if_absent(key, data)
            else:
                run.store.put_if_match(key, data, etag)
            return new
        except PreconditionFailed:
            time.sleep(0.05)
    raise PreconditionFailed(f"{run.store.url_of(key)} kept changing while it was updated: try again")


def admit(run: Run, name: str, key: str) -> Worker:
    """Admit public key `key` as worker `name` (a revoked name may be admitted again)."""
    validate_name("worker", name)
    key = check_public(key, "--key")

    def change(allow: Allowlist) -> Allowlist:
        holder = allow.by_key(key)
        if holder is not None and holder.name != name:
            raise ConfigurationError(f"key {key[:16]}... is already admitted as worker {holder.name!r}: one key, one name")
        current = allow.workers.get(name)
        if current is not None and current.active and current.key != key:
            raise ConfigurationError(f"worker name {name!r} is admitted with another key: revoke it first (`paths keys revoke RUN --name {name}`), or pick another name")
        return Allowlist(allow.open, {**allow.workers, name: Worker(name, key, time.time())})

    return _update(run, change).workers[name]


def revoke(run: Run, who: str) -> Worker:
    """Revoke the worker named `who` (or holding key `who`): its batches are no longer read."""

    def change(allow: Allowlist) -> Allowlist:
        worker = allow.workers.get(who) or allow.by_key(who.strip().lower())
        if worker is None:
            raise ConfigurationError(f"no worker named or keyed {who!r} in {run.store.url_of(run.allowlist())}: `paths keys list` shows who is admitted")
        return Allowlist(allow.open, {**allow.workers, worker.name: replace(worker, revoked_at=worker.revoked_at or time.time())})

    allow = _update(run, change)
    return allow.workers.get(who) or allow.by_key(who.strip().lower())


def set_open(run: Run, is_open: bool) -> Allowlist:
    """Open the run to unsigned batches (trusted machines), or close it again."""
    return _update(run, lambda allow: Allowlist(is_open, dict(allow.workers)))
