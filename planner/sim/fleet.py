"""Which job each worker serves, and what it costs: activation starts its first fetch, deactivation
returns its leases to the pool, and every worker is billed from activation to deactivation or death."""

from __future__ import annotations

from planner.sim.clock import Clock
from planner.sim.dissemination import Dissemination
from planner.sim.leases import Leases
from planner.sim.state import LEASED, JobState, WorkerState


class Fleet:
    def __init__(self, clock: Clock, leases: Leases, dissemination: Dissemination) -> None:
        self.clock = clock
        self.leases = leases
        self.dissemination = dissemination

    def activate(self, w: WorkerState, job: JobState) -> None:
        w.inc += 1
        w.job = job
        w.since = self.clock.now
        w.version = -1
        job.workers[w] = None
        job.activations += 1
        job.peak_active = max(job.peak_active, len(job.workers))
        self.dissemination.fetch_first(w, job)

    def deactivate(self, w: WorkerState) -> None:
        job = w.job
        self.bill(w)
        for pid in w.leases:
            job.return_to_pool(pid, LEASED)
        job.in_flight -= len(w.leases)
        released = bool(w.leases)
        w.leases = {}
        w.busy = 0
        w.inc += 1
        w.version = -1
        w.job = None
        job.workers.pop(w, None)
        job.deactivations += 1
        if released:
            self.leases.wake(job)

    def bill(self, w: WorkerState) -> None:
        if w.since is not None and w.job is not None:
            seconds = self.clock.now - w.since
            w.seconds_active += seconds
            w.job.worker_cost += seconds * w.price / 3600
        w.since = None

    def reprice(self, w: WorkerState, price: float) -> None:
        """An active worker's time so far is billed at the old price."""
        if w.since is not None and w.job is not None:
            self.bill(w)
            w.since = self.clock.now
        w.price = price
