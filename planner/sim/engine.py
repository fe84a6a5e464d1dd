"""Discrete-event model of one Echo2 deployment, driven by the real capacity + solver code.

What is modelled
  * Learner (one per job; sim/learner.py), as learner/loop.py runs: a step takes T_train (± jitter)
    plus `step_overhead_s` outside training, and starts only when R admissible groups are buffered;
    a learner waiting for groups sees them `learner_poll_s` after they arrive (0: the live learner's
    claims long-poll, so it sees them at once). It claims in arrival order
    (the control plane's queue is by submission time). A group made with version x is admissible
    at step t iff JobSpec.admissible(t, x) (t − x ≤ S); staler groups are dropped at the claim
    and their prompts return to the pool. Every κ steps it publishes the version it is about
    to train; workers hear of it `notice_s` later (0: the live long-poll) and then fetch it.
  * Relay dissemination of each version over the job's active workers (sim/dissemination.py over
    sim/relay.py): the job's `version_gb` (a delta or an adapter) to workers holding the previous
    version, the whole `model_gb` to a newly activated one.
  * Workers (sim/fleet.py, sim/churn.py): `concurrency` groups at once, T_gen each, always with the
    newest version they hold; billed from activation to deactivation or death. Preemption (per type
    or as a scenario event) and rejoin.
  * Server (sim/leases.py): prompts are leased, never chosen, under the live staleness contract
    (api/services/pool.py lease_room): a worker holding version x gets a prompt only while the
    groups queued and in flight are fewer than the learner can train before x goes stale,
    (x + S − t + 1)·R less the step in training. Leases carry a TTL renewed by heartbeats
    (every `tick_s`); a dead worker's leases expire and return at the next reconcile tick,
    i.e. at most TTL + one heartbeat after the death.
  * Scheduler (sim/reconcile.py): every tick it builds WorkerProfile/JobProfile from what a server
    could measure (sim/measure.py: heartbeat liveness, nominal μ and T_gen, last observed T_bcast or
    an estimate for workers that have not fetched yet) and applies `planner.solver.decide` — the same
    code the reconcile loop runs.

Every prompt is tracked through pool → leased → ready → consumed (or back to the pool), and
the transitions are checked, so "prompts lost" is measured, not assumed.
"""

from __future__ import annotations

import random
import time
from collections import deque

import numpy as np

from planner.sim.churn import Churn
from planner.sim.clock import Clock
from planner.sim.dissemination import Dissemination
from planner.sim.fleet import Fleet
from planner.sim.learner import Learner
from planner.sim.leases import Leases
from planner.sim.reconcile import Reconciler
from planner.sim.report import JobResult, SimResult
from planner.sim.scenario import Scenario, expand_workers
from planner.sim.state import JobState, WorkerState


class Simulation:
    def __init__(self, scenario: Scenario) -> None:
        self.sc = scenario
        self.rng = random.Random(scenario.seed + 1)  # one stream for the whole world, drawn in event order
        self.workers = [
            WorkerState(s, s.price_per_h, self.rng.uniform(0, scenario.tick_s), i)
            for i, s in enumerate(expand_workers(scenario))
        ]
        self.jobs = []
        for spec in scenario.jobs:
            total = spec.rollouts_per_step * spec.max_steps
            prompts, seen = deque(range(total)), np.full(len(self.workers), np.nan)
            self.jobs.append(JobState(spec, spec.platform_spec(), prompts, bytearray(total), spec.t_train_s, seen))
        self.clock = Clock()
        self.leases = Leases(self.clock)
        self.dissemination = Dissemination(scenario, self.clock, self.workers, self.leases)
        self.fleet = Fleet(self.clock, self.leases, self.dissemination)
        self.learner = Learner(scenario, self.clock, self.rng, self.leases, self.fleet, self.dissemination)
        self.leases.on_group = self.learner.try_start
        self.churn = Churn(scenario, self.clock, self.rng, self.workers, self.fleet)
        self.reconciler = Reconciler(
            scenario, self.clock, self.rng, self.jobs, self.workers, self.leases, self.fleet, self.dissemination
        )

    def run(self) -> SimResult:
        started, cpu_started = time.perf_counter(), time.process_time()
        for job in self.jobs:
            self.clock.push(job.spec.submit_at_s, self.learner.submit, job)
        self.churn.start()
        self.clock.push(0.0, self.reconciler.tick)
        self.clock.run(self.sc.max_sim_s, lambda: all(j.done for j in self.jobs))
        for w in self.workers:
            if w.job is not None:
                self.fleet.deactivate(w)
        return self._result(time.perf_counter() - started, time.process_time() - cpu_started)

    def _result(self, runtime_s: float, cpu_s: float) -> SimResult:
        end = self.clock.now
        return SimResult(
            scenario=self.sc.name,
            method=self.sc.solver.method,
            n_workers=len(self.workers),
            sim_s=end,
            runtime_s=runtime_s,
            cpu_s=cpu_s,
            jobs=[JobResult.of(job, end) for job in self.jobs],
            worker_hours=sum(w.seconds_active for w in self.workers) / 3600,
            resolves=len(self.reconciler.decisions),
            ticks=self.reconciler.ticks,
            decisions=self.reconciler.summaries,
            kills=self.churn.kills,
            lease_returns=self.leases.returns,
            full_decisions=self.reconciler.decisions,
        )


def simulate(scenario: Scenario) -> SimResult:
    return Simulation(scenario).run()
