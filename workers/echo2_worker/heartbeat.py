"""The worker's presence in the fleet. A thread reports liveness, status, progress, the versions held and
bad relay sources every interval (even while a long generation runs) and at once when asked
(`beat_now`: a download completed, a version was announced), and keeps the control plane's latest
reply, which says what to work on. A reply that challenges a version held (`Assignment.challenges`:
prove you hold it) is answered from the copy on disk in a beat sent at once, so a new version costs
one more round trip before its first lease, not an interval. `leave` deregisters.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from echo2 import errors
from echo2.protocol import Assignment, BadSource, Heartbeat, HeartbeatReply, WorkerStatus
from echo2.transport import RetryPolicy

from .control import ControlPlane
from .progress import Stats
from .versions import MAX_BACKOFF_S, VersionKey, Versions

log = logging.getLogger(__name__)
ONCE = RetryPolicy(max_retries=0)


def _retry_in(exc: errors.Echo2Error, interval: float) -> float:
    """When to beat again after a failed beat: an interval on, a little less at random (a fleet that lost the
    control plane at once does not come back in step), or later if the control plane asked (Retry-After)."""
    asked = getattr(exc, "retry_after", None)
    if asked is not None:
        return min(float(asked), MAX_BACKOFF_S)
    return interval * (1 - 0.25 * random.random())


class WorkerGone(Exception):
    """The control plane no longer knows this worker (deregistered elsewhere, or token revoked)."""


class BadSources:
    """Relay sources that served bad chunks, sent with the next heartbeat. Download threads report them,
    the heartbeat thread takes them; `_lock` guards `_bad`."""

    def __init__(self) -> None:
        self._bad: dict[str, str] = {}
        self._lock = threading.Lock()

    def report(self, url: str, reason: str) -> None:
        with self._lock:
            self._bad[url] = reason

    def take(self) -> list[BadSource]:
        with self._lock:
            bad = [BadSource(url=u, reason=r[:500]) for u, r in list(self._bad.items())[:32]]
            self._bad.clear()
        return bad


class Heartbeats:
    """`status` is written by the main thread. `_reply_lock` guards `_reply` and `_reported` (what the last
    beat said the worker holds, less what its reply still challenges: what it may lease at), written here
    and read by the main and notice threads; `_reported` is replaced whole, so it is also read unlocked."""

    def __init__(self, control: ControlPlane, worker_id: str, interval_s: float, versions: Versions, stats: Stats,
                 bad_sources: BadSources, *, on_reply: Callable[[], None],
                 on_gone: Callable[[WorkerGone], None]) -> None:
        self.control, self.worker_id, self.versions, self.stats = control, worker_id, versions, stats
        self.status = WorkerStatus.idle
        self._interval_s, self._bad, self._on_reply, self._on_gone = interval_s, bad_sources, on_reply, on_gone
        self._reply: HeartbeatReply | None = None
        self._reply_lock = threading.Lock()
        self._reported: tuple[str | None, frozenset[int]] = (None, frozenset())
        self._asked: frozenset[tuple[int, int, int]] = frozenset()  # the last reply's challenges
        self._notice: str | None = None  # the last reply's word to the operator, logged when it changes
        self._now = threading.Event()  # set to beat before the interval is up
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="echo2-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._now.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def leave(self) -> bool:
        """Deregister (after `stop`): the control plane assigns nothing more here. False if it was not told."""
        try:
            self.control.deregister(self.worker_id)
        except errors.Echo2Error as exc:
            log.warning("could not deregister (%s); the server will mark this worker offline", exc)
            return False
        log.info("deregistered worker %s", self.worker_id)
        return True

    def beat_now(self) -> None:
        self._now.set()

    def latest(self) -> HeartbeatReply | None:
        with self._reply_lock:
            return self._reply

    def assignment(self) -> Assignment | None:
        reply = self.latest()
        return reply.assignment if reply is not None else None

    def parents(self, a: Assignment) -> list[str]:
        """The relay parents of `a`'s job as the latest reply names them (they change while a download runs)."""
        latest = self.assignment()
        return latest.relay_parents if latest is not None and latest.job_id == a.job_id else a.relay_parents

    def watching(self) -> tuple[str, int] | None:
        """The job and newest version the last reply named, for the version watcher."""
        a = self.assignment()
        return (a.job_id, a.version) if a is not None else None

    def await_reported(self, held: VersionKey, stop: threading.Event, timeout: float = 10.0) -> bool:
        """A lease is granted only at a version a heartbeat reported and, if challenged, proved: after a
        download, beat (and answer) and wait for it."""
        job_id, version = held
        deadline = time.monotonic() + timeout
        while self._reported[0] != job_id or version not in self._reported[1]:
            if stop.is_set() or time.monotonic() > deadline:
                return False
            self._now.set()
            stop.wait(0.05)
        return True

    def _run(self) -> None:
        # A beat is tried once (no transport retries: this loop is the retry) and a failed one again at the
        # beat's own pace, which costs the control plane no more than beating does: an exponential backoff
        # (to 30 s, on top of the transport's retries) left a worker silent 17-19 s after a 13 s outage, and
        # the scheduler marks a worker offline after 15 s, releasing the leases it was generating for.
        failures = 0
        while not self._stop.is_set():
            interval = self._interval_s
            try:
                body = self._body()
                reply = self.control.heartbeat(self.worker_id, body, policy=ONCE)
                self._received(body, reply)
                if failures:
                    log.info("control plane reachable again")
                failures = 0
                interval = reply.heartbeat_interval_s
                self._on_reply()
            except errors.AuthenticationError as exc:
                self._on_gone(WorkerGone(f"the control plane no longer accepts this worker's token ({exc.status}); "
                                         "it was deregistered elsewhere - run `echo2-worker join` again"))
                return
            except errors.Echo2Error as exc:
                failures += 1
                interval = _retry_in(exc, interval)
                log.warning("heartbeat failed (%s); next try in %.0fs", exc, interval)
            self._now.wait(interval)
            self._now.clear()

    def _received(self, body: Heartbeat, reply: HeartbeatReply) -> None:
        """Keep the reply; beat again at once when it challenges anew (the last one asked something else)."""
        asked = frozenset((c.version, c.offset, c.length) for c in reply.assignment.challenges) \
            if reply.assignment is not None else frozenset()
        with self._reply_lock:
            self._reply = reply
            self._reported = (body.job_id, frozenset(body.versions_held) - {v for v, _, _ in asked})
        if asked - self._asked:
            self._now.set()  # a challenge answered a whole interval later would hold the first lease back
        self._asked = asked
        if reply.notice != self._notice:  # e.g. quarantined: an idle worker that said nothing looked merely unused
            if reply.notice:
                log.warning("the control plane says: %s", reply.notice)
            else:
                log.info("the control plane's notice is lifted")
            self._notice = reply.notice

    def _body(self) -> Heartbeat:
        bad = self._bad.take()
        job, held = self.versions.holdings()
        a = self.assignment()
        proofs = self.versions.prove(job, a.challenges if a is not None and a.job_id == job else [])
        return Heartbeat(status=self.status, job_id=job, version_held=max(held) if held else None,
                         versions_held=held, stats=self.stats.worker_stats(), bad_sources=bad,
                         fetched_from=self.versions.take_fetched()[:16], proofs=proofs)
