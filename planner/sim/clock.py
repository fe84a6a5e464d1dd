"""The simulator's clock: a queue of events, each a handler and its arguments, run in time order."""

from __future__ import annotations

import heapq
from collections.abc import Callable

Handler = Callable[..., None]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Handler, tuple]] = []
        self._seq = 0  # ties run in the order they were scheduled, so handlers are never compared

    def push(self, at: float, handler: Handler, *payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, handler, payload))

    def run(self, until: float, finished: Callable[[], bool]) -> None:
        """Runs the events due by `until`; stops early once `finished()` holds after one."""
        while self._heap:
            at, _, handler, payload = heapq.heappop(self._heap)
            if at > until:
                return
            self.now = at
            handler(*payload)
            if finished():
                return
