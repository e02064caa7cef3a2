"""Worker keys and the run's allowlist through the CLI: admit, list, revoke, open, close; and every
bad input a one-line error with nothing written."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from cli.main import main
from paths.errors import ConfigurationError
from paths.work.rollouts import read_allowlist
from paths.work.train import train
from tests.paths.work.conftest import prompt_run
from tests.paths.work.rollouts.conftest import settings, start


def invoke(*args: str):
    r = CliRunner().invoke(main, list(args))
    return r.exit_code, r.output


def test_admit_list_revoke_open_close(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    key = str(tmp_path / "w.key")
    code, out = invoke("keys", "new", "--out", key)
    public = out.strip().rsplit(" ", 1)[1]
    assert code == 0 and oct(os.stat(key).st_mode & 0o777) == "0o600"
    assert invoke("keys", "show", "--key", key) == (0, public + "\n")
    assert invoke("keys", "new", "--out", key)[0] == 1  # never overwritten by accident
    assert invoke("keys", "admit", run.url, "--name", "cpu-1", "--key", public)[0] == 0
    code, out = invoke("keys", "admit", run.url, "--name", "cpu-2", "--key", public)
    assert code == 1 and "already admitted as worker 'cpu-1'" in out
    code, out = invoke("keys", "list", run.url)
    assert code == 0 and "closed" in out and f"cpu-1" in out and public in out and "admitted" in out
    assert invoke("keys", "revoke", run.url, "cpu-1")[0] == 0
    assert not read_allowlist(run).workers["cpu-1"].active
    start(run, tmp_path)
    code, out = invoke("rollout", run.url, "--path", "p00", "--dataset", "rl", "--key", key, "--no-progress")
    assert code == 1 and "was revoked" in out
    assert invoke("keys", "open", run.url)[0] == 0 and read_allowlist(run).open
    assert invoke("keys", "close", run.url)[0] == 0 and not read_allowlist(run).open
    code, out = invoke("keys", "list", run.url, "--json")
    assert json.loads(out)["workers"]["cpu-1"]["revoked_at"] is not None


def test_bad_keys_and_allowlists_are_one_line_errors(tmp_path, tokenizer_dir):
    run = prompt_run(tmp_path, tokenizer_dir, holdout=0.0)
    start(run, tmp_path)
    rollout = ["rollout", run.url, "--path", "p00", "--dataset", "rl", "--no-progress", "--wait", "1"]
    code, out = invoke(*rollout)
    assert code == 1 and "takes signed rollout batches only" in out and "paths keys new" in out
    code, out = invoke(*rollout, "--key", str(tmp_path / "missing.key"))
    assert code == 1 and "cannot read worker key" in out and "paths keys new" in out
    unreadable = tmp_path / "locked.key"
    invoke("keys", "new", "--out", str(unreadable))
    os.chmod(unreadable, 0)
    if not os.access(unreadable, os.R_OK):  # root reads anything
        code, out = invoke(*rollout, "--key", str(unreadable))
        assert code == 1 and "cannot read worker key" in out
    garbage = tmp_path / "garbage.key"
    garbage.write_text("not a key")
    code, out = invoke(*rollout, "--key", str(garbage))
    assert code == 1 and "is not an unencrypted PEM private key" in out
    stranger = str(tmp_path / "stranger.key")
    invoke("keys", "new", "--out", stranger)
    code, out = invoke(*rollout, "--key", stranger)
    assert code == 1 and "is not admitted to" in out and "paths keys admit" in out
    code, out = invoke("keys", "admit", run.url, "--name", "w", "--key", "abc")
    assert code == 1 and "is not an Ed25519 public key" in out
    code, out = invoke("keys", "admit", run.url, "--name", "../w", "--key", "ab" * 32)
    assert code == 1 and "invalid worker name" in out
    assert not run.store.exists(run.allowlist())  # nothing written by any of them
    code, out = invoke("keys", "revoke", run.url, "nobody")
    assert code == 1 and "no worker named or keyed 'nobody'" in out
    for nonsense, expected in [(b"{not json", "is not JSON"), (b'{"format": "x"}', "is not a version-1 paths-allowlist"),
                               (json.dumps({"format": "paths-allowlist", "version": 1, "open": False, "workers": {"w": {"key": "zz", "admitted_at": 1}}}).encode(), "not an Ed25519 public key")]:
        run.store.write(run.allowlist(), nonsense)
        code, out = invoke(*rollout, "--key", stranger)
        assert code == 1 and expected in out and len(out.strip().splitlines()) == 1, out
        with pytest.raises(ConfigurationError, match=expected):
            train(run, "p00", "grpo", "rl", settings(), None, show_progress=False)
        assert not run.store.list("work/p00")  # the trainer stopped before training
