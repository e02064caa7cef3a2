"""Waiting on the store: pauses that start short and back off, and a due time that holds the
short looks back until the awaited write is expected."""

from __future__ import annotations

import pytest

from paths.work.rollouts.poll import FIRST, Poll


class Clock:
    """A fake clock: sleeping moves it; the pauses slept, in order."""

    def __init__(self):
        self.now, self.slept = 1000.0, []

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_pauses_double_from_the_first_up_to_the_most():
    c = Clock()
    p = Poll(0.2, clock=lambda: c.now, sleep=c.sleep)
    for _ in range(8):
        p.sleep()
    assert c.slept[:5] == pytest.approx([FIRST, 2 * FIRST, 4 * FIRST, 8 * FIRST, 16 * FIRST]) and c.slept[5:] == [0.2] * 3
    p.reset()
    p.sleep()
    assert c.slept[-1] == FIRST  # something moved: short again


def test_before_the_due_time_looks_stay_apart_then_start_short():
    c = Clock()
    p = Poll(0.2, due=c.now + 0.5, clock=lambda: c.now, sleep=c.sleep)
    for _ in range(6):
        p.sleep()
    assert c.slept == pytest.approx([0.2, 0.2, 0.1, FIRST, 2 * FIRST, 4 * FIRST])  # apart until due, then short looks backing off


def test_the_pace_is_the_trainers_seconds_a_version_from_its_own_stamps():
    from paths.work.rollouts.poll import Pace

    c = Clock()
    pace = Pace(clock=lambda: c.now)
    pace.saw(0, 5000.0)  # the trainer's clock runs 4,000 s ahead of ours: only differences count
    assert pace.due() is None
    c.now += 0.9
    pace.saw(1, 5001.0)
    assert pace.due() == pytest.approx(c.now + 1.0)
    pace.saw(1, 5001.3)  # the same version written again (pending changed): no new pace
    c.now += 2.0
    pace.saw(3, 5002.0)  # two versions in 1 s: 0.5 s each, weighted 0.3 into 1.0
    assert pace.due() == pytest.approx(c.now + 0.85)
