"""Waiting on the store: pauses that start short and back off, and a due time that holds the
short looks back until the awaited write is expected."""

from __future__ import annotations

import pytest

from paths.work.rollouts import poll as poll_module
from paths.work.rollouts.poll import FIRST, Poll


@pytest.fixture
def clock(monkeypatch):
    """time.time and time.sleep of the poll module on a fake clock; the pauses slept, in order."""
    now, slept = [1000.0], []

    def sleep(s):
        slept.append(s)
        now[0] += s

    monkeypatch.setattr(poll_module.time, "time", lambda: now[0])
    monkeypatch.setattr(poll_module.time, "sleep", sleep)
    return now, slept


def test_pauses_double_from_the_first_up_to_the_most(clock):
    _, slept = clock
    p = Poll(0.2)
    for _ in range(8):
        p.sleep()
    assert slept[:5] == pytest.approx([FIRST, 2 * FIRST, 4 * FIRST, 8 * FIRST, 16 * FIRST]) and slept[5:] == [0.2] * 3


def test_before_the_due_time_looks_stay_apart_then_start_short(clock):
    now, slept = clock
    p = Poll(0.2, due=now[0] + 0.5)
    for _ in range(6):
        p.sleep()
    assert slept == pytest.approx([0.2, 0.2, 0.1, FIRST, 2 * FIRST, 4 * FIRST])  # apart until due, then short looks backing off
