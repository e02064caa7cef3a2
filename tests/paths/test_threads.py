"""torch's thread count on a shared CPU: one thread a core the other processes leave free, the
user's setting when there is one, and a clear error for a bad one."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from paths.errors import ConfigurationError
from paths.threads import Threads, running_elsewhere, setting, threads_for


def test_threads_for_leaves_the_busy_cores():
    assert [threads_for(2, k) for k in (0, 0.4, 1, 2, 4)] == [2, 2, 1, 1, 1]
    assert threads_for(8, 3) == 5 and threads_for(8, 0) == 8


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_busy_processes_are_counted_and_the_count_follows_them(monkeypatch):
    monkeypatch.setenv("PATHS_THREADS", "auto")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.5)
        assert running_elsewhere() >= 2
        threads = Threads(every=0.0)
        threads.check()
        assert torch.get_num_threads() <= max(1, len(os.sched_getaffinity(0)) - 2)  # the spinners' cores are left to them (other load only lowers it)
    finally:
        for p in spin:
            p.kill()
            p.wait()
        torch.set_num_threads(before)


def test_the_users_setting_wins(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("PATHS_THREADS", "1")
        Threads().check()
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("PATHS_THREADS", "auto")
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert setting() == "fixed"
        monkeypatch.setenv("PATHS_THREADS", "many")
        with pytest.raises(ConfigurationError, match="PATHS_THREADS must be auto, fixed or a number of threads, got 'many'"):
            Threads()
    finally:
        torch.set_num_threads(before)
