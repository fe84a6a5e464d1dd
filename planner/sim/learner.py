"""The learner of each job, as learner/loop.py runs it: it claims R admissible groups in arrival
order, trains a step of T_train (± jitter) plus the overhead outside training, and publishes every κ
steps; a waiting learner sees arriving groups at its next poll."""

from __future__ import annotations

import math
import random
from collections import Counter, deque

from planner.sim.clock import Clock
from planner.sim.dissemination import Dissemination
from planner.sim.fleet import Fleet
from planner.sim.leases import Leases
from planner.sim.scenario import Scenario
from planner.sim.state import CONSUMED, READY, JobState


class Learner:
    def __init__(
        self,
        scenario: Scenario,
        clock: Clock,
        rng: random.Random,
        leases: Leases,
        fleet: Fleet,
        dissemination: Dissemination,
    ) -> None:
        self.sc = scenario
        self.clock = clock
        self.rng = rng
        self.leases = leases
        self.fleet = fleet
        self.dissemination = dissemination

    def submit(self, job: JobState) -> None:
        job.submitted = True
        job.step_started = self.clock.now
        self.dissemination.publish(job, 0)

    def try_start(self, job: JobState) -> None:
        if job.busy or job.done or not job.submitted:
            return
        returned = self._drop_stale(job)
        if len(job.ready) < job.spec.rollouts_per_step:
            if job.waiting_since is None:
                job.waiting_since = self.clock.now
            if returned:
                self.leases.wake(job)
            return
        due = self._next_poll(job)
        if due > self.clock.now:  # a waiting learner sees the groups only at its next claim
            if not job.claim_due:
                job.claim_due = True
                self.clock.push(due, self.claim, job)
            return
        self._start(job)

    def claim(self, job: JobState) -> None:
        job.claim_due = False
        self.try_start(job)

    def _next_poll(self, job: JobState) -> float:
        poll = self.sc.learner_poll_s
        if job.waiting_since is None or poll <= 0:
            return self.clock.now
        waited = self.clock.now - job.waiting_since
        return job.waiting_since + math.ceil(waited / poll - 1e-9) * poll

    def _drop_stale(self, job: JobState) -> int:
        """Queued groups no longer admissible are rejected at the claim; their prompts return."""
        if not job.ready or min(job.ready_versions) >= job.rules.oldest_admissible(job.step):
            return 0
        kept: deque[tuple[int, int]] = deque()
        returned = 0
        for version, pid in job.ready:
            if job.rules.admissible(job.step, version):
                kept.append((version, pid))
                continue
            job.return_to_pool(pid, READY)
            job.ready_versions[version] -= 1
            returned += 1
        job.ready_versions = Counter({v: n for v, n in job.ready_versions.items() if n})
        job.ready = kept
        job.dropped += returned
        return returned

    def _start(self, job: JobState) -> None:
        spec = job.spec
        now = self.clock.now
        for _ in range(spec.rollouts_per_step):
            version, pid = job.ready.popleft()
            job.ready_versions[version] -= 1
            if not job.ready_versions[version]:
                del job.ready_versions[version]
            job.move(pid, READY, CONSUMED)
        job.consumed += spec.rollouts_per_step
        jitter = spec.t_train_jitter
        duration = spec.t_train_s * (1 + self.rng.uniform(-jitter, jitter)) if jitter else spec.t_train_s
        job.busy, job.waiting_since = True, None
        job.step_started = now
        job.busy_s += duration
        if job.first_step_at is None:
            job.first_step_at = now
        self.clock.push(now + duration + self.sc.step_overhead_s, self.step, job, duration)
        self.leases.wake(job)

    def step(self, job: JobState, duration: float) -> None:
        job.step += 1
        job.busy = False
        job.t_meas = 0.8 * job.t_meas + 0.2 * duration  # what the learner heartbeat reports
        if job.step >= job.spec.max_steps:
            self._finish(job)
            return
        if job.step % job.spec.publish_period == 0:
            self.dissemination.publish(job, job.step)
        self.try_start(job)
        if not job.busy:
            self.leases.wake(job)

    def _finish(self, job: JobState) -> None:
        job.done = True
        job.finished_at = self.clock.now
        for w in list(job.workers):
            self.fleet.deactivate(w)
