"""The worker loop: heartbeat -> follow the desired state -> hold the assigned version -> lease
prompts -> generate G samples each -> submit version-tagged groups -> repeat.

The main thread runs this loop and generation (generate.py: a batch of prompts into groups, with
partial.py and episodes.py); the rest runs beside it:
- heartbeat.py: a thread that reports liveness, progress and bad relay sources every interval (and at
  once when a version is held or announced), keeps the latest reply and renews leases due;
- notice.py: a thread that long-polls for the next version of the job and asks for that heartbeat;
- versions.py: a download thread that fetches the assigned version (a keyframe and/or deltas, through
  the relay tree) while the current, still admissible one keeps generating (swaps are done there
  too, on the main thread);
- leases.py: a "net" thread that books the next lease and submits groups while generation runs.

Versions: a lease is taken with the version loaded in the backend (`held`, passed down explicitly),
and every group of it is tagged with that version. When a newer version is announced the current lease
is finished (if still admissible) and the weights are swapped before the next lease. A lease whose
version fell below the assignment's `min_version` is released without generating more: its rollouts
would be rejected. Only the loaded and the newest version (and what a download in flight uses) are
kept on disk.

Drain (SIGTERM/SIGINT, `request_drain`): stop leasing, submit the batch in flight, release the rest,
deregister, exit 0. A SIGKILL loses nothing: the server expires the lease and re-pools its prompts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from echo2.protocol import Assignment, DesiredState, LeaseRead, WorkerStatus

from .backends import GenerationBackend
from .control import ControlPlane
from .generate import Generator
from .heartbeat import BadSources, Heartbeats, WorkerGone
from .leases import Leases, NoLease
from .notice import VersionWatcher
from .partial import PartialRollouts
from .progress import Stats
from .store import VersionStore
from .versions import PAUSES, VersionKey, Versions

log = logging.getLogger(__name__)


@dataclass
class LoopOptions:
    worker_id: str
    data_dir: Path
    max_prompts: int = 8
    gen_batch_prompts: int | None = None  # prompts per backend call; None = the whole lease
    heartbeat_interval_s: float = 2.0
    relay_url: str | None = None


class Worker:
    def __init__(self, options: LoopOptions, control: ControlPlane, backend_factory: Callable[[], GenerationBackend],
                 store: VersionStore, stats: Stats | None = None,
                 on_deregistered: Callable[[], None] | None = None) -> None:
        self.opt = options
        self.stats = stats or Stats()
        self._on_deregistered = on_deregistered
        self._changed = threading.Event()  # wakes the main thread: a reply, a version held, a drain, an error
        self._drain = threading.Event()
        self._fatal: WorkerGone | None = None  # set by the heartbeat or net thread, raised by the main one
        self._gen_failures = 0
        bad = BadSources()
        self.versions = Versions(control, store, self.stats, backend_factory, relay_url=options.relay_url,
                                 on_held=self._version_changed, on_bad_source=bad.report)
        self.heartbeats = Heartbeats(control, options.worker_id, options.heartbeat_interval_s, self.versions,
                                     self.stats, bad, on_reply=self._replied, on_gone=self._gone)
        self.leases = Leases(control, self.stats, options.max_prompts, on_gone=self._gone)
        self._partial = PartialRollouts(self.versions, self.heartbeats.assignment, self.heartbeats.parents)
        self._generator = Generator(self.versions, self._partial, control, self.stats)
        self._watcher = VersionWatcher(control, self.heartbeats.watching, self.heartbeats.beat_now)

    def request_drain(self) -> None:
        """Stop leasing; the batch in flight is submitted, the rest of the lease released; then exit."""
        self._drain.set()
        self.versions.cancel()
        self._changed.set()

    @property
    def draining(self) -> bool:
        return self._drain.is_set()

    def run(self) -> int:
        """Work until drained; returns the process exit code."""
        self.heartbeats.start()
        self._watcher.start()
        try:
            while not self._drain.is_set():
                if self._fatal is not None:
                    raise self._fatal
                a = self._assignment()
                held = self._hold(a) if a is not None else None
                if held is not None:
                    self._work_one_lease(held)
            return 0
        except WorkerGone as exc:
            log.error("%s", exc)
            if self._on_deregistered is not None:
                self._on_deregistered()
            return 3
        finally:
            self._shutdown()

    def _assignment(self) -> Assignment | None:
        """The job to work on; None (after a wait) while the control plane wants this worker idle."""
        reply = self.heartbeats.latest()
        if reply is None or reply.desired is not DesiredState.active or reply.assignment is None:
            draining = reply is not None and reply.desired is DesiredState.drain
            self._set_status(WorkerStatus.draining if draining else WorkerStatus.idle)
            self.leases.drop_prefetch()
            self._wait(1.0)
            return None
        self._set_status(WorkerStatus.active)
        return reply.assignment

    def _hold(self, a: Assignment) -> VersionKey | None:
        """The admissible version in the backend to lease with; None (after a wait) while there is none."""
        loaded = self.versions.loaded
        held = self.versions.hold(a, lambda: self.heartbeats.parents(a))
        if self.versions.loaded != loaded:
            self.leases.drop_prefetch()  # it was booked at the version just replaced
        if held is None:
            self._wait(1.0)
        return held

    def _work_one_lease(self, held: VersionKey) -> None:
        lease = self._take_lease(held)
        if lease is None:
            return
        try:
            done, ok = self._generate_lease(lease)
            self._gen_failures = 0
        except (WorkerGone, KeyboardInterrupt):
            raise
        except Exception as exc:  # a backend failure: give the prompts back, retry a few times
            self.leases.finish(lease, 0, ok=False)
            self._gen_failures += 1
            if self._gen_failures >= 3:
                raise
            log.warning("generation failed (%s: %s); retrying", type(exc).__name__, exc)
            self._wait(PAUSES.backoff(self._gen_failures))
            return
        self.leases.finish(lease, done, ok)

    def _take_lease(self, held: VersionKey) -> LeaseRead | None:
        """The lease prefetched at `held`, else one booked now; None, after waiting as the answer says, if none."""
        lease = self.leases.take_prefetched(held)
        if lease is not None:
            return lease
        if not self.heartbeats.await_reported(held, self._drain):
            return None
        try:
            return self.leases.book(held)
        except NoLease as no:
            if no.for_reply:
                self._await_new_reply(no.wait_s)
            else:
                self._wait(no.wait_s)
            return None

    def _generate_lease(self, lease: LeaseRead) -> tuple[int, bool]:
        """Generate the lease's prompts batch by batch, each batch submitted in the background.
        Returns how many prompts were generated, and False if a submission was refused."""
        step = self.opt.gen_batch_prompts or len(lease.prompts)
        done = 0
        refused = threading.Event()
        while done < len(lease.prompts):
            why = "a submission was refused" if refused.is_set() else self._stop_reason(lease)
            if why:
                log.info("lease %s: stopping after %d/%d prompts (%s)", lease.id, done, len(lease.prompts), why)
                break
            self.leases.prefetch(None if self._drain.is_set() else self.versions.settled())
            batch = lease.prompts[done : done + step]
            for groups in self._generator.groups(batch, lease):
                self.leases.submit(lease, groups, refused)
            done += len(batch)
        return done, not refused.is_set()

    def _stop_reason(self, lease: LeaseRead) -> str | None:
        if self._drain.is_set():
            return "draining"
        reply = self.heartbeats.latest()
        if reply is None:
            return None
        a = reply.assignment
        if reply.desired is not DesiredState.active or a is None or a.job_id != lease.job_id:
            return f"desired state is {reply.desired.value}"
        # With partial rollouts the lease does not pin the version: its next batch starts on the newest held.
        version = self._partial.refresh() if lease.sampling.partial_rollouts else lease.version
        if version < a.min_version:
            return f"version {version} is too stale (oldest admissible: {a.min_version})"
        return None

    def _replied(self) -> None:
        self._changed.set()
        self.leases.renew_due()

    def _version_changed(self) -> None:
        self.heartbeats.beat_now()
        self._changed.set()

    def _gone(self, exc: WorkerGone) -> None:
        self._fatal = exc
        self._changed.set()

    def _wait(self, seconds: float) -> None:
        self._changed.wait(seconds)
        self._changed.clear()

    def _await_new_reply(self, timeout: float) -> None:
        first = self.heartbeats.latest()
        deadline = time.monotonic() + timeout
        while not self._drain.is_set() and self.heartbeats.latest() is first and time.monotonic() < deadline:
            self._wait(deadline - time.monotonic())

    def _set_status(self, status: WorkerStatus) -> None:
        self.heartbeats.status = status
        self.stats.state = "draining" if self._drain.is_set() else status.value

    def _shutdown(self) -> None:
        """Flush submissions, release what is still leased, stop heartbeating, deregister (on drain)."""
        self._drain.set()
        self.versions.cancel()
        self.stats.state = "stopping"
        self.leases.close()
        self._watcher.stop()
        self.heartbeats.stop()
        if self._fatal is None and self.heartbeats.leave() and self._on_deregistered is not None:
            self._on_deregistered()
        self.versions.close()
