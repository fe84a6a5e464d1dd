"""Notices: a caller long-polls for something of a job and hears of it as soon as it happens, instead of
polling. Workers wait for the next version of their job (`versions`); the learner waits for rollouts
to claim (`rollouts`).

Publishing a version or accepting rollouts wakes the waiters on that key in this API process at once.
Waiters also look at the database every RECHECK_S, so what happened through another API process
(several behind a load balancer) reaches them within that much."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict

RECHECK_S = 2.0


def versions(job_id: str) -> str:
    return f"{job_id}/versions"


def rollouts(job_id: str) -> str:
    return f"{job_id}/rollouts"


class Announcer:
    """One per API process (app.state.announcer)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, asyncio.Event] = defaultdict(asyncio.Event)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def announce(self, key: str) -> None:
        """Wake everyone waiting on `key`; safe to call from any thread (routes run in a pool)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake, key)

    def _wake(self, key: str) -> None:
        event = self._events.pop(key, None)
        if event is not None:
            event.set()

    async def wait(self, key: str, timeout: float) -> None:
        """Until the next announcement on `key` or `timeout` seconds, whichever comes first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._events[key].wait(), timeout)
