"""Waiting on another machine through the store: looks that start short and back off, and when
the awaited write is due."""

from __future__ import annotations

import time
from typing import Callable

FIRST = 0.01  # seconds: the first pause, when what we wait for is likely near


class Poll:
    """The pauses between looks at the store while waiting: FIRST seconds, doubling up to `most`.
    With `due` (a time.time() at which the awaited write is expected, e.g. a trainer's next
    version one step period after its last), looks before it stay `most` apart and the short ones
    start there, so a wait costs little latency and few requests either way."""

    def __init__(self, most: float, due: float | None = None, clock: Callable[[], float] | None = None, sleep: Callable[[float], None] | None = None):
        self.most, self.due, self.pause = most, due, FIRST
        self.clock, self._sleep = clock or time.time, sleep or time.sleep  # a test's fake clock, else the real one

    def reset(self) -> None:
        """Something moved: the next pause is short again."""
        self.pause = FIRST

    def sleep(self) -> None:
        ahead = 0.0 if self.due is None else self.due - self.clock()
        if ahead > FIRST:  # not yet due: a look now and then, until it is
            self._sleep(min(self.most, ahead))
            return
        self._sleep(self.pause)
        self.pause = min(self.most, self.pause * 2)


class Pace:
    """When a trainer's next policy version is due, as a worker sees it: the mean (exponentially
    weighted) of the trainer's own seconds per version, from the `at` stamps it publishes (their
    differences: no clock skew), after the local time the newest version was first seen."""

    def __init__(self, clock: Callable[[], float] | None = None):
        self.clock = clock or time.time
        self.version, self.at, self.seen_at, self.period = -1, 0.0, 0.0, None

    def saw(self, version: int, at: float) -> None:
        """latest.json says `version`, published at `at` (the trainer's clock; 0 if unknown)."""
        if version == self.version:
            return
        if version > self.version >= 0 and at and self.at:
            step = (at - self.at) / (version - self.version)
            self.period = step if self.period is None else 0.7 * self.period + 0.3 * step
        self.version, self.at, self.seen_at = version, at, self.clock()

    def due(self) -> float | None:
        """Local time the next version is expected (None before the pace is known)."""
        return None if self.period is None else self.seen_at + self.period
