"""The server's side of prompts: leases under the live staleness contract, groups coming back from
workers, and the leases of dead workers returning to the pool once they expire."""

from __future__ import annotations

from collections.abc import Callable

from planner.sim.clock import Clock
from planner.sim.report import LeaseReturn
from planner.sim.state import LEASED, POOL, READY, JobState, WorkerState


class Leases:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.on_group: Callable[[JobState], None]  # a group came back: the learner may start (set by the engine)
        self.returns: list[LeaseReturn] = []

    def room(self, job: JobState, version: int) -> int:
        """The live lease rule (api/services/pool.py lease_room): groups of `version` the learner can
        still train before it goes stale, less the step in training and what is queued and in flight
        (in flight counted whatever its version: the server sees leases, not their fate)."""
        spec = job.spec
        oldest = job.rules.oldest_admissible(job.step)
        queued = sum(n for v, n in job.ready_versions.items() if v >= oldest)
        claimed = spec.rollouts_per_step if job.busy else 0
        steps_left = version + spec.staleness - job.step + 1
        return steps_left * spec.rollouts_per_step - claimed - queued - job.in_flight

    def fill(self, w: WorkerState) -> None:
        job = w.job
        if job is None or w.version < 0 or job.done:
            return
        now = self.clock.now
        t_gen = w.t_gen(job)
        while w.busy < w.spec.concurrency and job.pool:
            if self.room(job, w.version) <= 0:
                return
            pid = job.pool.popleft()
            job.move(pid, POOL, LEASED)
            job.in_flight += 1
            w.busy += 1
            w.leases[pid] = now
            self.clock.push(now + t_gen, self.done, w, w.inc, pid, w.version)

    def wake(self, job: JobState) -> None:
        for w in job.workers:
            if w.busy < w.spec.concurrency:
                self.fill(w)

    def done(self, w: WorkerState, inc: int, pid: int, version: int) -> None:
        if w.inc != inc:
            return  # released on deactivation or orphaned on death
        job = w.job
        w.busy -= 1
        del w.leases[pid]
        job.in_flight -= 1
        job.move(pid, LEASED, READY)
        job.queue(version, pid)
        self.on_group(job)
        self.fill(w)

    def expire(self, jobs: list[JobState]) -> None:
        """Dead workers' leases past their TTL go back to the pool (the reconcile tick's sweep)."""
        now = self.clock.now
        for job in jobs:
            if not job.orphans:
                continue
            keep = []
            for o in job.orphans:
                if o.expires_at > now:
                    keep.append(o)
                    continue
                for pid in o.pids:
                    job.return_to_pool(pid, LEASED)
                job.in_flight -= len(o.pids)
                self.returns.append(LeaseReturn(o.worker_id, job.spec.job_id, o.killed_at, now, len(o.pids)))
            if len(keep) != len(job.orphans):
                job.orphans = keep
                self.wake(job)
