"""Waiting on another machine through the store: looks that start short and back off."""

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
