"""The scheduler's reconcile tick: expired leases return, then the activation set is decided by
`planner.solver.decide` — the code the live reconcile loop runs — from what a server could measure
(planner.sim.measure: heartbeat liveness, nominal μ and T_gen, the last observed T_bcast or an estimate),
and applied."""

from __future__ import annotations

import random

from planner.decision import Decision, SolverState
from planner.sim.clock import Clock
from planner.sim.dissemination import Dissemination
from planner.sim.fleet import Fleet
from planner.sim.leases import Leases
from planner.sim.measure import Measurements
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
        self.jobs = jobs
        self.job_by_id = {j.spec.job_id: j for j in jobs}
        self.workers = workers
        self.leases = leases
        self.fleet = fleet
        self.dissemination = dissemination
        self.measurements = Measurements(scenario, rng, workers, dissemination)
        self.index = {w.spec.worker_id: i for i, w in enumerate(workers)}
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

    def _reconcile(self, running: list[JobState]) -> None:
        profiles = self.measurements.profiles_for(running)
        jobs = [j.spec.profile(j.t_meas) for j in running]
        d = decide(jobs, profiles, self.clock.now, self.state, self.sc.solver)
        self.state = d.state
        if d.resolved:
            self.decisions.append(d)
            self.summaries.append(DecisionSummary.of(d))
        assignment = d.state.assignment
        # only a worker assigned now or serving now can change; in fleet order, as the events they start
        touched = {self.index[wid] for wid in assignment}
        touched |= {self.index[w.spec.worker_id] for job in self.jobs for w in job.workers}
        for w in (self.workers[i] for i in sorted(touched)):
            target = self.job_by_id.get(assignment.get(w.spec.worker_id, ""))
            if w.job is target:
                continue
            if w.job is not None:
                self.fleet.deactivate(w)
            if target is not None and w.alive and not target.done:
                self.fleet.activate(w, target)
