"""Discrete-event model of one Echo2 deployment, driven by the real capacity + solver code.

What is modelled
  * Learner (one per job), as learner/loop.py runs: a step takes T_train (± jitter) plus
    `step_overhead_s` outside training, and starts only when R admissible groups are buffered;
    a learner waiting for groups sees them `learner_poll_s` after they arrive (0: the live learner's
    claims long-poll, so it sees them at once). It claims in arrival order
    (the control plane's queue is by submission time). A group made with version x is admissible
    at step t iff JobSpec.admissible(t, x) (t − x ≤ S); staler groups are dropped at the claim
    and their prompts return to the pool. Every κ steps it publishes the version it is about
    to train; workers hear of it `notice_s` later (0: the live long-poll) and then fetch it.
  * Relay dissemination of each version over the job's active workers (scheduler.sim.relay): the
    job's `version_gb` (a delta or an adapter) to workers holding the previous version, the whole
    `model_gb` to a newly activated one.
  * Workers: `concurrency` groups at once, T_gen each, always with the newest version they
    hold; billed from activation to deactivation or death. Preemption (per type or as a
    scenario event) and rejoin.
  * Server: prompts are leased, never chosen, under the live staleness contract
    (api/services/pool.py lease_room): a worker holding version x gets a prompt only while the
    groups queued and in flight are fewer than the learner can train before x goes stale,
    (x + S − t + 1)·R less the step in training. Leases carry a TTL renewed by heartbeats
    (every `tick_s`); a dead worker's leases expire and return at the next reconcile tick,
    i.e. at most TTL + one heartbeat after the death.
  * Scheduler: every tick it builds WorkerProfile/JobProfile from what a server could measure
    (heartbeat liveness, nominal μ and T_gen, last observed T_bcast or an estimate for workers
    that have not fetched yet) and applies `planner.solver.decide` — the same code the
    reconcile loop runs.

Every prompt is tracked through pool → leased → ready → consumed (or back to the pool), and
the transitions are checked, so "prompts lost" is measured, not assumed.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import Counter, deque

from planner.capacity import WorkerPerf, WorkerProfile, estimate_bcast_s
from planner.decision import Decision, SolverState
from planner.solver import decide
from scheduler.sim.relay import Peer, broadcast
from scheduler.sim.report import DecisionSummary, JobResult, LeaseReturn, SimResult
from scheduler.sim.scenario import Scenario, expand_workers
from scheduler.sim.state import CONSUMED, LEASED, POOL, READY, InvariantError, JobState, Orphans, WorkerState

TICK, DONE, VERSION, STEP, KILL, REJOIN, SUBMIT, EVENT, CLAIM = range(9)


class Simulation:
    def __init__(self, scenario: Scenario) -> None:
        self.sc = scenario
        self.rng = random.Random(scenario.seed + 1)
        self.now = 0.0
        self.heap: list[tuple] = []
        self.seq = 0
        self.workers = [
            WorkerState(s, s.price_per_h, self.rng.uniform(0, scenario.tick_s)) for s in expand_workers(scenario)
        ]
        self.by_id = {w.spec.worker_id: w for w in self.workers}
        self.jobs = []
        for spec in scenario.jobs:
            total = spec.rollouts_per_step * spec.max_steps
            self.jobs.append(JobState(spec, deque(range(total)), bytearray(total), spec.t_train_s))
        self.job_by_id = {j.spec.job_id: j for j in self.jobs}
        self.state: SolverState | None = None
        self.decisions: list[Decision] = []
        self.summaries: list[DecisionSummary] = []
        self.kills: list[tuple[float, str]] = []
        self.returns: list[LeaseReturn] = []
        self.ticks = 0

    # ------------------------------------------------------------ plumbing

    def push(self, at: float, kind: int, *payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, kind, payload))

    def _set(self, job: JobState, pid: int, old: int, new: int) -> None:
        if job.state[pid] != old:
            raise InvariantError(f"{job.spec.job_id} prompt {pid}: state {job.state[pid]}, expected {old}")
        job.state[pid] = new

    def run(self) -> SimResult:
        started, cpu_started = time.perf_counter(), time.process_time()
        for job in self.jobs:
            self.push(job.spec.submit_at_s, SUBMIT, job)
        for w in self.workers:
            if w.spec.preempt_mean_s > 0:
                self.push(self.rng.expovariate(1 / w.spec.preempt_mean_s), KILL, w, w.life)
        for i, ev in enumerate(self.sc.events):
            self.push(ev.at_s, EVENT, i)
        self.push(0.0, TICK)
        handlers = {
            TICK: self._tick, DONE: self._done, VERSION: self._version, STEP: self._step,
            KILL: self._kill_event, REJOIN: self._rejoin, SUBMIT: self._submit, EVENT: self._scenario_event,
            CLAIM: self._claim,
        }  # fmt: skip
        while self.heap:
            at, _, kind, payload = heapq.heappop(self.heap)
            if at > self.sc.max_sim_s:
                break
            self.now = at
            handlers[kind](*payload)
            if all(j.done for j in self.jobs):
                break
        for w in self.workers:
            if w.job is not None:
                self._deactivate(w)
        return self._result(time.perf_counter() - started, time.process_time() - cpu_started)

    # ------------------------------------------------------------ learner

    def _submit(self, job: JobState) -> None:
        job.submitted = True
        job.step_started = self.now
        self._publish(job, 0)

    def _try_start(self, job: JobState) -> None:
        if job.busy or job.done or not job.submitted:
            return
        returned = self._drop_stale(job)
        if len(job.ready) < job.spec.rollouts_per_step:
            if job.waiting_since is None:
                job.waiting_since = self.now
            if returned:
                self._wake(job)
            return
        due = self._next_poll(job)
        if due > self.now:  # a waiting learner sees the groups only at its next claim
            if not job.claim_due:
                job.claim_due = True
                self.push(due, CLAIM, job)
            return
        self._start(job)

    def _next_poll(self, job: JobState) -> float:
        poll = self.sc.learner_poll_s
        if job.waiting_since is None or poll <= 0:
            return self.now
        waited = self.now - job.waiting_since
        return job.waiting_since + math.ceil(waited / poll - 1e-9) * poll

    def _claim(self, job: JobState) -> None:
        job.claim_due = False
        self._try_start(job)

    def _drop_stale(self, job: JobState) -> int:
        """Queued groups no longer admissible are rejected at the claim; their prompts return."""
        floor = job.step - job.spec.staleness
        if not job.ready or min(job.ready_versions) >= floor:
            return 0
        kept: deque[tuple[int, int]] = deque()
        returned = 0
        for version, pid in job.ready:
            if version >= floor:
                kept.append((version, pid))
                continue
            self._set(job, pid, READY, POOL)
            job.pool.appendleft(pid)
            job.ready_versions[version] -= 1
            returned += 1
        job.ready_versions = Counter({v: n for v, n in job.ready_versions.items() if n})
        job.ready = kept
        job.dropped += returned
        return returned

    def _start(self, job: JobState) -> None:
        spec = job.spec
        for _ in range(spec.rollouts_per_step):
            version, pid = job.ready.popleft()
            job.ready_versions[version] -= 1
            if not job.ready_versions[version]:
                del job.ready_versions[version]
            self._set(job, pid, READY, CONSUMED)
        job.consumed += spec.rollouts_per_step
        jitter = spec.t_train_jitter
        duration = spec.t_train_s * (1 + self.rng.uniform(-jitter, jitter)) if jitter else spec.t_train_s
        job.busy, job.waiting_since = True, None
        job.step_started = self.now
        job.busy_s += duration
        if job.first_step_at is None:
            job.first_step_at = self.now
        self.push(self.now + duration + self.sc.step_overhead_s, STEP, job, duration)
        self._wake(job)

    def _step(self, job: JobState, duration: float) -> None:
        job.step += 1
        job.busy = False
        job.t_meas = 0.8 * job.t_meas + 0.2 * duration  # what the learner heartbeat reports
        if job.step >= job.spec.max_steps:
            self._finish(job)
            return
        if job.step % job.spec.publish_period == 0:
            self._publish(job, job.step)
        self._try_start(job)
        if not job.busy:
            self._wake(job)

    def _finish(self, job: JobState) -> None:
        job.done = True
        job.finished_at = self.now
        for w in list(job.workers):
            self._deactivate(w)

    def _publish(self, job: JobState, version: int) -> None:
        job.latest = version
        relay = self.sc.relay
        peers = [Peer(i, w.spec.down_Bps, w.spec.up_Bps) for i, w in enumerate(self.workers) if w.job is job]
        b = broadcast(
            peers, job.spec.version_bytes, relay.chunk_mb * 1e6, relay.origin_up_mbps * 1e6 / 8,
            relay.topology, relay.fanout, relay.hop_latency_s, relay.origin_fanout,
        )  # fmt: skip
        if peers:
            # smoothed, so the estimate the scheduler uses for workers it has not measured yet
            # does not jump with every change of the tree
            rate = b.newcomer_rate_Bps
            job.hint_rate = rate if not job.hint_rate else 0.7 * job.hint_rate + 0.3 * rate
            job.hint_depth = b.max_depth if relay.topology == "star" else b.max_depth + 1
        for key, t in b.times.items():
            w = self.workers[key]
            self.push(self.now + self.sc.notice_s + t, VERSION, w, w.inc, version, t)

    # ------------------------------------------------------------ workers

    def _t_gen(self, w: WorkerState, job: JobState) -> float:
        return w.spec.t_gen_s * job.spec.gen_scale

    def _estimate_bcast(self, w: WorkerState, job: JobState) -> float:
        relay = self.sc.relay
        rate = job.hint_rate or relay.origin_up_mbps * 1e6 / 8 / relay.origin_fanout
        return estimate_bcast_s(
            job.spec.model_gb * 1e9,
            w.spec.down_Bps,
            rate,
            job.hint_depth,
            relay.chunk_mb * 1e6,
            relay.hop_latency_s,
        )

    def _room(self, job: JobState, version: int) -> int:
        """The live lease rule (api/services/pool.py lease_room): groups of `version` the learner can
        still train before it goes stale, less the step in training and what is queued and in flight
        (in flight counted whatever its version: the server sees leases, not their fate)."""
        spec = job.spec
        floor = job.step - spec.staleness
        queued = sum(n for v, n in job.ready_versions.items() if v >= floor)
        claimed = spec.rollouts_per_step if job.busy else 0
        steps_left = version + spec.staleness - job.step + 1
        return steps_left * spec.rollouts_per_step - claimed - queued - job.in_flight

    def _fill(self, w: WorkerState) -> None:
        job = w.job
        if job is None or w.version < 0 or job.done:
            return
        t_gen = self._t_gen(w, job)
        while w.busy < w.spec.concurrency and job.pool:
            if self._room(job, w.version) <= 0:
                return
            pid = job.pool.popleft()
            self._set(job, pid, POOL, LEASED)
            job.in_flight += 1
            w.busy += 1
            w.leases[pid] = self.now
            self.push(self.now + t_gen, DONE, w, w.inc, pid, w.version)

    def _wake(self, job: JobState) -> None:
        for w in job.workers:
            if w.busy < w.spec.concurrency:
                self._fill(w)

    def _done(self, w: WorkerState, inc: int, pid: int, version: int) -> None:
        if w.inc != inc:
            return  # released on deactivation or orphaned on death
        job = w.job
        w.busy -= 1
        del w.leases[pid]
        job.in_flight -= 1
        self._set(job, pid, LEASED, READY)
        self._queue(job, version, pid)
        self._try_start(job)
        self._fill(w)

    @staticmethod
    def _queue(job: JobState, version: int, pid: int) -> None:
        job.ready.append((version, pid))
        job.ready_versions[version] += 1

    def _version(self, w: WorkerState, inc: int, version: int, took: float) -> None:
        if w.inc != inc or w.job is None:
            return
        if version > w.version:
            w.version = version
            w.bcast[w.job.spec.job_id] = took
            self._fill(w)

    def _activate(self, w: WorkerState, job: JobState) -> None:
        w.inc += 1
        w.job = job
        w.since = self.now
        w.version = -1
        job.workers[w] = None
        job.activations += 1
        job.peak_active = max(job.peak_active, len(job.workers))
        took = self._estimate_bcast(w, job)
        self.push(self.now + took, VERSION, w, w.inc, job.latest, took)

    def _bill(self, w: WorkerState) -> None:
        if w.since is not None and w.job is not None:
            seconds = self.now - w.since
            w.seconds_active += seconds
            w.job.worker_cost += seconds * w.price / 3600
        w.since = None

    def _deactivate(self, w: WorkerState) -> None:
        job = w.job
        self._bill(w)
        for pid in w.leases:
            self._set(job, pid, LEASED, POOL)
            job.pool.appendleft(pid)
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
            self._wake(job)

    def _kill(self, w: WorkerState) -> None:
        if not w.alive:
            return
        self.kills.append((self.now, w.spec.worker_id))
        # heartbeats at hb_phase + k·tick; the last one before the death renewed its leases
        tick = self.sc.tick_s
        beat = self.now - ((self.now - w.hb_phase) % tick) if self.now >= w.hb_phase else 0.0
        w.last_hb = max(beat, w.last_hb)
        job = w.job
        if job is not None:
            self._bill(w)
            # the server keeps them leased until they expire: TTL after the later of the lease
            # and the last heartbeat that renewed it
            expiring: dict[float, list[int]] = {}
            for pid, leased_at in w.leases.items():
                expiring.setdefault(max(leased_at, w.last_hb) + self.sc.lease_ttl_s, []).append(pid)
            for expires_at, pids in expiring.items():
                job.orphans.append(Orphans(expires_at, pids, self.now, w.spec.worker_id))
            job.workers.pop(w, None)
        w.leases = {}
        w.busy = 0
        w.alive = False
        w.inc += 1
        w.life += 1
        w.version = -1
        w.job = None
        if w.spec.rejoin_after_s > 0:
            self.push(self.now + w.spec.rejoin_after_s, REJOIN, w, w.life)

    def _kill_event(self, w: WorkerState, life: int) -> None:
        if w.life == life and w.alive:
            self._kill(w)

    def _rejoin(self, w: WorkerState, life: int) -> None:
        if w.life != life or w.alive:
            return
        w.alive = True
        w.life += 1
        w.last_hb = self.now
        if w.spec.preempt_mean_s > 0:
            self.push(self.now + self.rng.expovariate(1 / w.spec.preempt_mean_s), KILL, w, w.life)

    def _scenario_event(self, index: int) -> None:
        ev = self.sc.events[index]
        if ev.kind == "kill_active":
            active = sorted(
                (w for w in self.workers if w.alive and w.job is not None and ev.job_id in ("", w.job.spec.job_id)),
                key=lambda w: w.spec.worker_id,
            )
            victims = self.rng.sample(active, round(ev.fraction * len(active)))
            for w in victims:
                self._kill(w)
                if ev.rejoin_after_s > 0:
                    self.push(self.now + ev.rejoin_after_s, REJOIN, w, w.life)
        elif ev.kind == "price":
            for w in self.workers:
                if w.spec.type_name == ev.worker_type:
                    self._bill_and_reprice(w, w.price * ev.price_factor)

    def _bill_and_reprice(self, w: WorkerState, price: float) -> None:
        if w.since is not None and w.job is not None:
            self._bill(w)
            w.since = self.now
        w.price = price

    # ------------------------------------------------------------ reconcile

    def _tick(self) -> None:
        self.ticks += 1
        self._expire_leases()
        running = [j for j in self.jobs if j.submitted and not j.done]
        if running:
            self._reconcile(running)
        if not all(j.done for j in self.jobs):
            self.push(self.now + self.sc.tick_s, TICK)

    def _expire_leases(self) -> None:
        for job in self.jobs:
            if not job.orphans:
                continue
            keep = []
            for o in job.orphans:
                if o.expires_at > self.now:
                    keep.append(o)
                    continue
                for pid in o.pids:
                    self._set(job, pid, LEASED, POOL)
                    job.pool.appendleft(pid)
                job.in_flight -= len(o.pids)
                self.returns.append(LeaseReturn(o.worker_id, job.spec.job_id, o.killed_at, self.now, len(o.pids)))
            if len(keep) != len(job.orphans):
                job.orphans = keep
                self._wake(job)

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
        out = []
        for w in self.workers:
            alive = w.alive or self.now - w.last_hb <= self.sc.dead_after_s
            perfs = {}
            for job in running:
                t_gen = self._t_gen(w, job)
                mu = w.spec.concurrency / t_gen
                measured = w.bcast.get(job.spec.job_id)  # the scheduler keeps the last measurement
                t_bcast = measured if measured is not None else self._estimate_bcast(w, job)
                if noise:
                    mu *= max(0.5, 1 + w.errors[0])
                    t_bcast *= max(0.5, 1 + w.errors[1])
                perfs[job.spec.job_id] = WorkerPerf(mu, t_gen, t_bcast)
            first = perfs[running[0].spec.job_id]
            out.append(
                WorkerProfile(
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
            )
        return out

    def _reconcile(self, running: list[JobState]) -> None:
        profiles = self._profiles(running)
        jobs = [j.spec.profile(j.t_meas) for j in running]
        d = decide(jobs, profiles, self.now, self.state, self.sc.solver)
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
                self._deactivate(w)
            if target is not None and w.alive and not target.done:
                self._activate(w, target)

    # ------------------------------------------------------------ result

    def _result(self, runtime_s: float, cpu_s: float) -> SimResult:
        end = self.now
        jobs = [JobResult.of(job, end) for job in self.jobs]
        return SimResult(
            scenario=self.sc.name,
            method=self.sc.solver.method,
            n_workers=len(self.workers),
            sim_s=end,
            runtime_s=runtime_s,
            cpu_s=cpu_s,
            jobs=jobs,
            worker_hours=sum(w.seconds_active for w in self.workers) / 3600,
            resolves=len(self.decisions),
            ticks=self.ticks,
            decisions=self.summaries,
            kills=self.kills,
            lease_returns=self.returns,
            full_decisions=self.decisions,
        )


def simulate(scenario: Scenario) -> SimResult:
    return Simulation(scenario).run()
