"""What happens to workers from outside: preemption (per type), rejoining, and the scenario's
events (killing a fraction of the active workers, changing a type's price)."""

from __future__ import annotations

import random

from planner.sim.clock import Clock
from planner.sim.fleet import Fleet
from planner.sim.scenario import Scenario
from planner.sim.state import Orphans, WorkerState


class Churn:
    def __init__(
        self, scenario: Scenario, clock: Clock, rng: random.Random, workers: list[WorkerState], fleet: Fleet
    ) -> None:
        self.sc = scenario
        self.clock = clock
        self.rng = rng
        self.workers = workers
        self.fleet = fleet
        self.kills: list[tuple[float, str]] = []

    def start(self) -> None:
        for w in self.workers:
            self.arm(w)
        for i, ev in enumerate(self.sc.events):
            self.clock.push(ev.at_s, self.scenario_event, i)

    def arm(self, w: WorkerState) -> None:
        """Schedules the preemption of this life of the worker, if its type is preemptible."""
        if w.spec.preempt_mean_s > 0:
            self.clock.push(self.clock.now + self.rng.expovariate(1 / w.spec.preempt_mean_s), self.preempt, w, w.life)

    def preempt(self, w: WorkerState, life: int) -> None:
        if w.life == life and w.alive:
            self.kill(w)

    def kill(self, w: WorkerState) -> None:
        if not w.alive:
            return
        now = self.clock.now
        self.kills.append((now, w.spec.worker_id))
        # heartbeats at hb_phase + k·tick; the last one before the death renewed its leases
        tick = self.sc.tick_s
        beat = now - ((now - w.hb_phase) % tick) if now >= w.hb_phase else 0.0
        w.last_hb = max(beat, w.last_hb)
        job = w.job
        if job is not None:
            self.fleet.bill(w)
            # the server keeps them leased until they expire: TTL after the later of the lease
            # and the last heartbeat that renewed it
            expiring: dict[float, list[int]] = {}
            for pid, leased_at in w.leases.items():
                expiring.setdefault(max(leased_at, w.last_hb) + self.sc.lease_ttl_s, []).append(pid)
            for expires_at, pids in expiring.items():
                job.orphans.append(Orphans(expires_at, pids, now, w.spec.worker_id))
            job.workers.pop(w, None)
        w.leases = {}
        w.busy = 0
        w.alive = False
        w.inc += 1
        w.life += 1
        w.version = -1
        w.job = None
        if w.spec.rejoin_after_s > 0:
            self.clock.push(now + w.spec.rejoin_after_s, self.rejoin, w, w.life)

    def rejoin(self, w: WorkerState, life: int) -> None:
        if w.life != life or w.alive:
            return
        w.alive = True
        w.life += 1
        w.last_hb = self.clock.now
        self.arm(w)

    def scenario_event(self, index: int) -> None:
        ev = self.sc.events[index]
        if ev.kind == "kill_active":
            active = sorted(
                (w for w in self.workers if w.alive and w.job is not None and ev.job_id in ("", w.job.spec.job_id)),
                key=lambda w: w.spec.worker_id,
            )
            victims = self.rng.sample(active, round(ev.fraction * len(active)))
            for w in victims:
                self.kill(w)
                if ev.rejoin_after_s > 0:
                    self.clock.push(self.clock.now + ev.rejoin_after_s, self.rejoin, w, w.life)
        elif ev.kind == "price":
            for w in self.workers:
                if w.spec.type_name == ev.worker_type:
                    self.fleet.reprice(w, w.price * ev.price_factor)
