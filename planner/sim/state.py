"""The simulated world's state: each job's prompts (tracked pool → leased → ready → consumed), its
learner and active set, and each worker's leases, version and bill. The engine moves it event by event."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
from echo2 import protocol

from planner.sim.scenario import JobSpec, WorkerSpec

POOL, LEASED, READY, CONSUMED = 0, 1, 2, 3  # a prompt's states


class InvariantError(AssertionError):
    """The simulator broke its own bookkeeping (a bug, never a scenario outcome)."""


@dataclass(slots=True, eq=False)
class Orphans:
    expires_at: float
    pids: list[int]
    killed_at: float
    worker_id: str


@dataclass(slots=True, eq=False)
class JobState:
    spec: JobSpec
    rules: protocol.JobSpec  # the platform's spec of the job: the staleness rule is its method
    pool: deque[int]
    state: bytearray
    t_meas: float
    bcast_seen: np.ndarray  # the scheduler's last measured T_bcast per worker (by WorkerState.index); NaN: none
    submitted: bool = False
    done: bool = False
    step: int = 0
    busy: bool = False
    step_started: float = 0.0
    busy_s: float = 0.0
    first_step_at: float | None = None
    finished_at: float | None = None
    ready: deque[tuple[int, int]] = field(default_factory=deque)  # (version, pid), in arrival order
    ready_versions: Counter[int] = field(default_factory=Counter)  # how many of `ready` per version
    waiting_since: float | None = None  # the learner ran out of groups at this time
    claim_due: bool = False  # a CLAIM event (the learner's next poll) is scheduled
    in_flight: int = 0  # leased, server view (includes leases of undetected dead workers)
    consumed: int = 0
    dropped: int = 0
    latest: int = 0
    workers: dict[WorkerState, None] = field(default_factory=dict)  # active set, insertion-ordered
    orphans: list[Orphans] = field(default_factory=list)
    hint_rate: float = 0.0  # what a newcomer's stream rate is expected to be
    hint_depth: int = 1
    worker_cost: float = 0.0
    activations: int = 0
    deactivations: int = 0
    peak_active: int = 0

    def move(self, pid: int, old: int, new: int) -> None:
        """Prompt `pid` goes from state `old` to `new`; finding it in any other state is a bookkeeping bug."""
        if self.state[pid] != old:
            raise InvariantError(f"{self.spec.job_id} prompt {pid}: state {self.state[pid]}, expected {old}")
        self.state[pid] = new

    def return_to_pool(self, pid: int, old: int) -> None:
        """A returned prompt goes to the head of the pool, so it is leased again first."""
        self.move(pid, old, POOL)
        self.pool.appendleft(pid)

    def queue(self, version: int, pid: int) -> None:
        self.ready.append((version, pid))
        self.ready_versions[version] += 1


@dataclass(slots=True, eq=False)
class WorkerState:
    spec: WorkerSpec
    price: float
    hb_phase: float
    index: int  # its place in the fleet, and its row in the scheduler's per-worker figures
    alive: bool = True
    inc: int = 0  # bumps on every (de)activation or death; stale events carry an old value
    life: int = 0  # bumps on death and rejoin; for preemption events
    job: JobState | None = None
    since: float | None = None  # billing start
    version: int = -1
    busy: int = 0
    leases: dict[int, float] = field(default_factory=dict)  # pid -> leased at
    last_hb: float = 0.0
    seconds_active: float = 0.0

    def t_gen(self, job: JobState) -> float:
        """Seconds this worker takes to generate one group of `job`."""
        return self.spec.t_gen_s * job.spec.gen_scale
