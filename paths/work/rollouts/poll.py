"""Waiting on another machine through the store: looks that start short and back off."""

from __future__ import annotations

import time

FIRST = 0.01  # seconds: the first pause, when what we wait for is likely near


class Poll:
    """The pauses between looks at the store while waiting: FIRST seconds, doubling up to `most`.
    With `due` (a time.time() at which the awaited write is expected, e.g. a trainer's next
    version one step period after its last), looks before it stay `most` apart and the short ones
    start there, so a wait costs little latency and few requests either way."""

    def __init__(self, most: float, due: float | None = None):
        self.most, self.due, self.pause = most, due, FIRST

    def sleep(self) -> None:
        ahead = 0.0 if self.due is None else self.due - time.time()
        if ahead > FIRST:  # not yet due: a look now and then, until it is
            time.sleep(min(self.most, ahead))
            return
        time.sleep(self.pause)
        self.pause = min(self.most, self.pause * 2)
