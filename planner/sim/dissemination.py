"""Versions reaching workers: each publication relayed over the job's active workers
(planner.sim.relay), the estimate the scheduler uses for workers it has not measured yet, and a
worker taking up a version once it holds it."""

from __future__ import annotations

from typing import Any

from numpy.typing import ArrayLike

from planner.capacity import estimate_bcast_s
from planner.sim.clock import Clock
from planner.sim.leases import Leases
from planner.sim.relay import Peer, broadcast
from planner.sim.scenario import Scenario
from planner.sim.state import JobState, WorkerState


class Dissemination:
    def __init__(self, scenario: Scenario, clock: Clock, workers: list[WorkerState], leases: Leases) -> None:
        self.sc = scenario
        self.clock = clock
        self.workers = workers
        self.leases = leases

    def publish(self, job: JobState, version: int) -> None:
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
            self.clock.push(self.clock.now + self.sc.notice_s + t, self.arrive, w, w.inc, version, t)

    def estimate_bcast(self, down_Bps: ArrayLike, job: JobState) -> Any:
        """T_bcast of a whole model for a worker of this downlink that joins the job's tree now: a float,
        or an array for an array of downlinks."""
        relay = self.sc.relay
        rate = job.hint_rate or relay.origin_up_mbps * 1e6 / 8 / relay.origin_fanout
        return estimate_bcast_s(
            job.spec.model_gb * 1e9,
            down_Bps,
            rate,
            job.hint_depth,
            relay.chunk_mb * 1e6,
            relay.hop_latency_s,
        )

    def fetch_first(self, w: WorkerState, job: JobState) -> None:
        """A newly activated worker fetches the whole model at the estimated rate."""
        took = self.estimate_bcast(w.spec.down_Bps, job)
        self.clock.push(self.clock.now + took, self.arrive, w, w.inc, job.latest, took)

    def arrive(self, w: WorkerState, inc: int, version: int, took: float) -> None:
        if w.inc != inc or w.job is None:
            return
        if version > w.version:
            w.version = version
            w.job.bcast_seen[w.index] = took
            self.leases.fill(w)
