"""`paths storage ...` as a user runs it: output, exit codes, one-line errors, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from cli.main import main
from storage.layout import FORMAT_VERSION


def paths(*args: str, env: dict | None = None) -> tuple[int, str, str]:
    """Run the CLI in-process; (exit code, stdout, stderr)."""
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def run_url(backend, tmp_path, request):
    """A run URL on each backend (S3 through env vars pointing at SeaweedFS, as a user sets them);
    memory:// works because CliRunner runs in this process."""
    if backend == "memory":
        return f"memory://cli-{tmp_path.name}"
    if backend == "local":
        return str(tmp_path / "run")
    request.getfixturevalue("s3_env")
    return f"s3://{request.getfixturevalue('bucket')}/cli-{tmp_path.name}"


def test_init_ls_du_verify_claims(run_url):
    assert paths("storage", "init", run_url)[0] == 0
    code, out, _ = paths("storage", "ls", run_url)
    assert code == 0 and "run.json" in out
    code, out, _ = paths("storage", "ls", run_url, "--json")
    assert [o["key"] for o in json.loads(out)] == ["run.json"]
    code, out, _ = paths("storage", "du", run_url, "--json")
    assert json.loads(out)["objects"] == 1
    code, out, _ = paths("storage", "verify", run_url)
    assert code == 0 and "all checksums match" in out
    assert paths("storage", "claims", run_url) == (0, "no claims\n", "")


def test_verify_fails_on_a_corrupt_artifact(run_url):
    from storage.layout import open_run
    from storage.manifest import ArtifactWriter

    paths("storage", "init", run_url)
    run = open_run(run_url)
    w = ArtifactWriter(run.store, "base")
    w.write("model.safetensors", b"weights")
    w.commit()
    run.store.write("base/model.safetensors", b"weightz")
    code, out, _ = paths("storage", "verify", run_url, "--json")
    assert code == 1
    assert json.loads(out)["problems"][0]["key"] == "base/model.safetensors"


def test_gc_is_a_dry_run_without_yes(run_url):
    from storage.layout import open_run

    paths("storage", "init", run_url)
    run = open_run(run_url)
    for step in (1, 2, 3):
        run.store.write(f"work/p0/ckpt-{step}/COMMITTED", b"")
    code, out, _ = paths("storage", "gc", run_url, "--keep", "1")
    assert code == 0 and "work/p0/ckpt-1" in out and "dry run" in out
    assert len(run.checkpoints("p0")) == 3
    code, out, _ = paths("storage", "gc", run_url, "--keep", "1", "--yes")
    assert code == 0 and run.checkpoints("p0") == [(3, True)]


@pytest.mark.parametrize(
    "args, message",
    [
        (["storage", "ls", "nosuch://x/y"], "unknown URL scheme 'nosuch'"),
        (["storage", "gc", "{run}", "--older-than", "soon"], "invalid duration 'soon'"),
        (["storage", "ls", "{run}", "--prefix", "../escape"], "invalid storage key"),
    ],
)
def test_bad_input_is_one_line_and_exit_1(tmp_path, args, message):
    url = str(tmp_path / "run")
    paths("storage", "init", url)
    code, out, err = paths(*[a.format(run=url) for a in args])
    assert code == 1 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_verify_on_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "data.txt").write_text("x")
    code, _, err = paths("storage", "verify", str(tmp_path))
    assert code == 1 and "not a paths run" in err
    assert sorted(os.listdir(tmp_path)) == ["data.txt"]  # nothing written


@pytest.mark.parametrize("content, message", [(b"{broken", "unreadable"), (json.dumps({"format_version": FORMAT_VERSION + 5}).encode(), "newer paths")])
def test_bad_run_json(tmp_path, content, message):
    paths("storage", "init", str(tmp_path))
    (tmp_path / "run.json").write_bytes(content)
    code, _, err = paths("storage", "ls", str(tmp_path))
    assert code == 1 and message in err
    assert (tmp_path / "run.json").read_bytes() == content  # untouched


@pytest.mark.s3
def test_missing_bucket_is_named_and_not_created(s3_env):
    from storage.url import open_store

    code, _, err = paths("storage", "ls", "s3://no-such-bucket/run")
    assert code == 1 and "bucket 'no-such-bucket' does not exist" in err and "paths storage init" in err
    store = open_store("s3://paths-probe", s3_env.storage_options, create=True)
    assert "no-such-bucket" not in [b.rstrip("/") for b in store.fs.ls("")]


@pytest.mark.s3
def test_credentials_are_never_printed(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-do-not-print")
    code, out, err = paths("storage", "ls", "s3://paths-test/run")
    assert code == 1 and "s3cr3t-do-not-print" not in out + err
    assert "denied" in err and "AWS_SECRET_ACCESS_KEY" in err


def test_console_script_exit_codes(tmp_path):
    """The installed `paths` command, as a shell sees it: exit 1 and one line, no traceback."""
    exe = os.path.join(os.path.dirname(sys.executable), "paths")
    proc = subprocess.run([exe, "storage", "ls", str(tmp_path / "nothing")], capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.startswith("error: no run at") and "Traceback" not in proc.stderr
    proc = subprocess.run([exe, "storage", "ls"], capture_output=True, text=True, env={**os.environ, "PATHS_RUN": ""})
    assert proc.returncode == 2  # usage error
