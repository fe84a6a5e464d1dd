"""Version notices: a worker long-polls for the next version of its job and hears of it as soon as it is
announced, instead of at its next heartbeat.

Publishing wakes the waiters of that job in this API process at once. Waiters also look at the
database every RECHECK_S, so a version published through another API process (several behind a load
balancer) reaches them within that much."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict

RECHECK_S = 2.0


class Announcer:
    """One per API process (app.state.announcer)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, asyncio.Event] = defaultdict(asyncio.Event)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def announce(self, job_id: str) -> None:
        """Wake everyone waiting on the job; safe to call from any thread (routes run in a pool)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake, job_id)

    def _wake(self, job_id: str) -> None:
        event = self._events.pop(job_id, None)
        if event is not None:
            event.set()

    async def wait(self, job_id: str, timeout: float) -> None:
        """Until the job's next announcement or `timeout` seconds, whichever comes first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._events[job_id].wait(), timeout)
