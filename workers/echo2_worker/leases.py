"""The worker's leases: booked at the version the backend holds, renewed before they expire, and finished
(completed, or released with what was not generated) once their groups are submitted.

Network calls that need not block generation run in order on one "net" thread: the next lease is
booked (prefetched) while the current one generates, and submissions go out while the next batch
generates. Order on that thread keeps each lease's submissions before its release.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from echo2 import errors
from echo2.protocol import GroupSubmit, LeaseRead, LeaseRequest, RolloutSubmit

from .control import ControlPlane
from .heartbeat import WorkerGone
from .progress import Stats
from .versions import PAUSES, VersionKey

log = logging.getLogger(__name__)


class NoLease(Exception):
    """No lease now: ask again after `wait_s`, or (`for_reply`) once the next heartbeat reply is in."""

    def __init__(self, wait_s: float, for_reply: bool = False) -> None:
        super().__init__(f"no lease for {wait_s:.1f}s")
        self.wait_s, self.for_reply = wait_s, for_reply


@dataclass
class _Held:
    lease: LeaseRead
    ttl_s: float
    renew_at: float


class Leases:
    """`_lock` guards `_held` (and its entries' `renew_at`), which the main, net and heartbeat threads all
    touch; `_prefetched` is the main thread's alone. `on_gone` hears of a token refused on the net thread."""

    def __init__(self, control: ControlPlane, stats: Stats, max_prompts: int,
                 on_gone: Callable[[WorkerGone], None]) -> None:
        self.control, self.stats, self.max_prompts, self._on_gone = control, stats, max_prompts, on_gone
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._net = ThreadPoolExecutor(max_workers=1, thread_name_prefix="echo2-net")
        self._prefetched: Future[LeaseRead | None] | None = None
        self._failures = 0  # booking failures in a row (main thread)
        self._refused = ""  # why the last lease was refused for now, said once (main thread)

    def active(self) -> list[LeaseRead]:
        with self._lock:
            return [h.lease for h in self._held.values()]

    def book(self, held: VersionKey) -> LeaseRead:
        """A lease of up to `max_prompts` prompts to generate with version `held`. Raises NoLease when the
        control plane has none for it now, WorkerGone when it refuses this worker's token."""
        try:
            lease = self._book(held)
        except errors.ConflictError as exc:
            if exc.retry_after is not None:  # no prompts free right now, or its groups wait for their audit
                if exc.detail != self._refused:  # said once: a provider sees why its worker waits
                    log.info("no lease for now: %s", exc.detail)
                    self._refused = exc.detail or ""
                raise NoLease(min(exc.retry_after, 5.0)) from None
            log.info("lease refused: %s", exc.detail)  # too stale or job not running: wait for the next reply
            raise NoLease(5.0, for_reply=True) from None
        except errors.PermissionDeniedError:
            raise NoLease(5.0, for_reply=True) from None
        except errors.AuthenticationError as exc:
            raise WorkerGone(f"the control plane no longer accepts this worker's token ({exc.status})") from None
        except errors.Echo2Error as exc:
            self._failures += 1
            delay = PAUSES.backoff(self._failures)
            log.warning("could not lease prompts (%s); retrying in %.1fs", exc, delay)
            raise NoLease(delay) from None
        self._failures, self._refused = 0, ""
        return lease

    def _book(self, held: VersionKey) -> LeaseRead:
        job_id, version = held
        lease = self.control.lease(LeaseRequest(job_id=job_id, max_prompts=self.max_prompts, version=version))
        ttl = max(1.0, (lease.expires_at - lease.created_at) / timedelta(seconds=1))
        with self._lock:
            self._held[lease.id] = _Held(lease, ttl, time.monotonic() + ttl / 2)
        return lease

    def prefetch(self, held: VersionKey | None) -> None:
        """Book the next lease at `held` in the background (None: a swap or a drain is coming, do not)."""
        if self._prefetched is not None or held is None:
            return

        def call() -> LeaseRead | None:
            try:
                return self._book(held)
            except errors.Echo2Error:
                return None  # the main loop books again itself, and handles the answer

        self._prefetched = self._net.submit(call)

    def take_prefetched(self, held: VersionKey) -> LeaseRead | None:
        """The prefetched lease when it was booked at `held`; one booked at another version is given back."""
        lease = self._take_prefetch()
        if lease is not None and (lease.job_id, lease.version) != held:
            self.finish(lease, 0, ok=False)
            return None
        return lease

    def drop_prefetch(self) -> None:
        """Give the prefetched lease back (it was booked at a version just replaced, or work stops)."""
        lease = self._take_prefetch()
        if lease is not None:
            self.finish(lease, 0, ok=False)

    def submit(self, lease: LeaseRead, groups: list[GroupSubmit], refused: threading.Event) -> None:
        """Submit the groups on the net thread; `refused` is set if the control plane does not take them."""
        self._on_net(self._submit, lease, groups, refused)

    def finish(self, lease: LeaseRead, done: int, ok: bool) -> None:
        """After the lease's submissions: release what was not generated (all answered = completed)."""
        self._on_net(self._finish, lease, done, ok)

    def renew_due(self) -> None:
        """Renew every lease past half its TTL (the heartbeat thread calls this after each beat)."""
        now = time.monotonic()
        with self._lock:
            due = [h for h in self._held.values() if now >= h.renew_at]
        for held in due:
            try:
                self.control.renew(held.lease.id)
                with self._lock:
                    held.renew_at = time.monotonic() + held.ttl_s / 2
                log.debug("renewed lease %s", held.lease.id)
            except errors.Echo2Error as exc:
                log.warning("could not renew lease %s: %s", held.lease.id, exc)

    def close(self) -> None:
        """Flush the net thread (the batch in flight is submitted; releases go out), release the rest."""
        try:
            self.drop_prefetch()
        except Exception as exc:  # the prefetch failed: nothing to give back
            log.debug("prefetch: %s", exc)
        self._net.shutdown(wait=True)
        for lease in self.active():
            self._release(lease, 0)

    def _take_prefetch(self) -> LeaseRead | None:
        future, self._prefetched = self._prefetched, None
        return future.result() if future is not None else None

    def _on_net(self, fn: Callable[..., Any], *args: Any) -> None:
        def run() -> None:
            try:
                fn(*args)
            except WorkerGone as exc:
                self._on_gone(exc)
            except Exception:
                log.exception("background %s failed", getattr(fn, "__name__", "call"))

        self._net.submit(run)

    def _submit(self, lease: LeaseRead, groups: list[GroupSubmit], refused: threading.Event) -> None:
        """Submit, retried by the control-plane client until the lease would have expired."""
        try:
            result = self.control.submit(lease.id, RolloutSubmit(groups=groups), give_up_after=self._ttl_left(lease.id))
        except errors.AuthenticationError as exc:
            raise WorkerGone(f"the control plane no longer accepts this worker's token ({exc.status})") from None
        except (errors.ConnectionError, errors.ServerError) as exc:
            log.warning("giving up on lease %s: %s (its prompts return to the pool)", lease.id, exc)
            refused.set()
            return
        except errors.APIStatusError as exc:
            log.warning("lease %s: submission refused: %s", lease.id, exc)
            refused.set()
            return
        accepted = [r for r in result.results if r.status.value == "accepted"]
        rejected = [r for r in result.results if r.status.value == "rejected"]
        self.stats.rollouts_accepted += len(accepted)
        self.stats.rollouts_rejected += len(rejected)
        self.stats.groups.add(len(accepted))
        for r in rejected[:3]:
            log.warning("prompt %d rejected: %s", r.prompt_id, r.reason)

    def _finish(self, lease: LeaseRead, done: int, ok: bool) -> None:
        try:
            if done < len(lease.prompts) or not ok:
                self._release(lease, done)
            else:
                self.stats.leases_done += 1
        finally:
            with self._lock:
                self._held.pop(lease.id, None)

    def _release(self, lease: LeaseRead, done: int) -> None:
        try:
            self.control.release(lease.id)
            log.info("released lease %s (%d of %d prompts not generated)", lease.id, len(lease.prompts) - done,
                     len(lease.prompts))
        except errors.Echo2Error as exc:
            log.warning("could not release lease %s (%s); it will expire server-side", lease.id, exc)

    def _ttl_left(self, lease_id: str) -> float:
        with self._lock:
            held = self._held.get(lease_id)
            if held is None:
                return 0.0
            return max(0.0, held.renew_at + held.ttl_s / 2 - time.monotonic())
