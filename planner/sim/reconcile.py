"""The scheduler's reconcile tick: expired leases return, then the activation set is decided by
`planner.solver.decide` — the code the live reconcile loop runs — from what a server could measure
(heartbeat liveness, nominal μ and T_gen, the last observed T_bcast or an estimate), and applied."""

from __future__ import annotations

import math
import random

from planner.capacity import WorkerPerf, WorkerProfile
from planner.decision import Decision, SolverState
from planner.sim.clock import Clock
from planner.sim.dissemination import Dissemination
from planner.sim.fleet import Fleet
from planner.sim.leases import Leases
from planner.sim.report import DecisionSummary
from planner.sim.scenario import Scenario
from planner.sim.state import JobState, WorkerState
from planner.solver import decide


class Reconciler:
    def __init__(
        self,
        scenario: Scenario,
        clock: Clock,
        rng: random.Random,
        jobs: list[JobState],
        workers: list[WorkerState],
        leases: Leases,
        fleet: Fleet,
        dissemination: Dissemination,
    ) -> None:
        self.sc = scenario
        self.clock = clock
        self.rng = rng
        self.jobs = jobs
        self.job_by_id = {j.spec.job_id: j for j in jobs}
        self.workers = workers
        self.leases = leases
        self.fleet = fleet
        self.dissemination = dissemination
        self.state: SolverState | None = None
        self.decisions: list[Decision] = []
        self.summaries: list[DecisionSummary] = []
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        self.leases.expire(self.jobs)
        running = [j for j in self.jobs if j.submitted and not j.done]
        if running:
            self._reconcile(running)
        if not all(j.done for j in self.jobs):
            self.clock.push(self.clock.now + self.sc.tick_s, self.tick)

    def _measurement_errors(self) -> None:
        """Relative errors of the scheduler's smoothed measurements (μ, T_bcast) per worker: they
        wander (an AR(1) process with a 5-minute correlation time), spread `measure_noise`."""
        sigma = self.sc.measure_noise
        rho = math.exp(-self.sc.tick_s / 300.0)
        kick = sigma * math.sqrt(1 - rho * rho)
        for w in self.workers:
            if not w.errors:
                w.errors = [self.rng.gauss(0, sigma), self.rng.gauss(0, sigma)]
            else:
                w.errors = [rho * e + self.rng.gauss(0, kick) for e in w.errors]

    def _profiles(self, running: list[JobState]) -> list[WorkerProfile]:
        noise = self.sc.measure_noise
        if noise:
            self._measurement_errors()
        return [self._profile(w, running, noise) for w in self.workers]

    def _profile(self, w: WorkerState, running: list[JobState], noise: float) -> WorkerProfile:
        alive = w.alive or self.clock.now - w.last_hb <= self.sc.dead_after_s
        perfs = {}
        for job in running:
            t_gen = w.t_gen(job)
            mu = w.spec.concurrency / t_gen
            measured = w.bcast.get(job.spec.job_id)  # the scheduler keeps the last measurement
            t_bcast = measured if measured is not None else self.dissemination.estimate_bcast(w, job)
            if noise:
                mu *= max(0.5, 1 + w.errors[0])
                t_bcast *= max(0.5, 1 + w.errors[1])
            perfs[job.spec.job_id] = WorkerPerf(mu, t_gen, t_bcast)
        first = perfs[running[0].spec.job_id]
        return WorkerProfile(
            worker_id=w.spec.worker_id,
            price_per_h=w.price,
            vram_gb=w.spec.vram_gb,
            backends=frozenset((w.spec.backend,)),
            mu=first.mu,
            t_gen_s=first.t_gen_s,
            t_bcast_s=first.t_bcast_s,
            alive=alive,
            perf_by_job=perfs if len(running) > 1 else {},
        )

    def _reconcile(self, running: list[JobState]) -> None:
        profiles = self._profiles(running)
        jobs = [j.spec.profile(j.t_meas) for j in running]
        d = decide(jobs, profiles, self.clock.now, self.state, self.sc.solver)
        self.state = d.state
        if d.resolved:
            self.decisions.append(d)
            self.summaries.append(DecisionSummary.of(d))
        assignment = d.state.assignment
        for w in self.workers:
            target = self.job_by_id.get(assignment.get(w.spec.worker_id, ""))
            if w.job is target:
                continue
            if w.job is not None:
                self.fleet.deactivate(w)
            if target is not None and w.alive and not target.done:
                self.fleet.activate(w, target)
