"""The capacity rule: how much rollout throughput keeps the learner busy, and which workers
are fresh enough to contribute to it.

Pure functions over plain dataclasses, so the reconcile loop can build the inputs from
database rows and the simulator can build them from its own model.

Symbols (DESIGN.md, "The capacity rule")

    R         rollouts (prompt groups) the learner consumes per step   JobProfile.rollouts_per_step
    T_train   learner seconds per step                                 JobProfile.t_train_s
    μ_i       rollout groups per second worker i generates (raw rate) WorkerPerf.mu
    T_bcast,i seconds for worker i to hold a newly published version   WorkerPerf.t_bcast_s
    T_gen,i   seconds for worker i to generate one group               WorkerPerf.t_gen_s
    S         staleness bound: a group made with version x is trainable at step t iff t − x ≤ S
    κ         publish period: the learner publishes a version every κ steps
    h         headroom (default 0.1)
    L_i       T_bcast,i + T_gen,i, the worker's latency

Freshness    worker i qualifies only if L_i ≤ (S − κ + 1) · T_train.

Throughput   Σ_{i∈A} u_i · μ_i ≥ (1 + h) · R / T_train — otherwise the learner waits for rollouts.

    u_i is the worker's admissible share: the fraction of what it generates that can still be
    trained. Timeline (learner never waiting): version x is published as step x starts, at
    x·T_train, reaches the worker at x·T_train + T_bcast,i and is its newest version for κ
    steps. The learner claims step t's batch when step t starts, so a group made with x must
    arrive by (x + S)·T_train: groups can be started with x during a window of
    W_i = S·T_train − L_i. A slot fits ⌊W_i / T_gen,i⌋ + 1 groups in it per κ·T_train, so

        u_i = min(1, (⌊W_i / T_gen,i⌋ + 1) · T_gen,i / (κ · T_train)),   and u_i = 1 when L_i ≤ (S − κ)·T_train.

    Every worker inside the freshness bound has W_i ≥ (κ − 1)·T_train ≥ 0, so it fits at least
    one group per version window and u_i > 0; but a worker near the bound yields little: with
    S = 2, κ = 1, T_train = 20 s and L_i = 35 s, u_i = 0.6 (in the simulator, counting such
    workers at full μ left the learner about a fifth idle).
    For κ = S = 1, T_bcast = 0 and T_gen = T_train — one batch generated per learner step, the
    PRIME-RL k = 1 setting — u = 1: one step of asynchrony hides generation of equal length.
    Feed μ as the raw generation rate; a measured accepted-rollouts rate already includes u.

Windowed-synchronous mode (S − κ + 1 = 0: S = 0 with κ = 1, or any κ = S + 1)
    The slack (S − κ + 1) · T_train is 0: no worker with non-zero latency can overlap its work
    with training, so applied literally the rule would exclude every worker. Here freshness is
    instead guaranteed by construction — the version published at step x stays admissible through
    step x + S = x + κ − 1, the last step before the next version, so at the start of each
    publication window the learner waits for rollouts of the newest version — and latency turns
    into learner idle time once per window: a window lasts
    κ · T_train + max_A T_bcast,i + max(max_A T_gen,i, R / Σ_A μ_i). So in this mode we (a) qualify
    a worker when L_i ≤ T_train, which caps the idle time any single worker can add to a window,
    (b) keep the throughput rule with u_i = 1, which bounds the generation phase to
    T_train / (1 + h), and (c) predict utilisation below 1 with the formula above. Utilisation ≥ 95 %
    is only reachable with slack, i.e. κ ≤ S.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
from echo2.protocol import max_publish_period, slack_steps
from numpy.typing import ArrayLike

DEFAULT_HEADROOM = 0.1
DEFAULT_T_TRAIN_S = 2.0  # T_train assumed for a job before its first step


class Miss(StrEnum):
    """What keeps a worker from qualifying for a job, as data (`Qualification.reason` says it in words);
    the values are the words a job's explanation counts them by ("excluded: 2 by freshness")."""

    liveness = "liveness"
    vram = "VRAM"
    backend = "backend"
    throughput = "other"  # no measured throughput
    price = "price"  # costs more a group than the job pays at most
    freshness = "freshness"


@dataclass(frozen=True, slots=True)
class WorkerPerf:
    """What a worker measurably does for one job (rates depend on the model being served)."""

    mu: float  # rollout groups per second
    t_gen_s: float  # seconds to generate one group
    t_bcast_s: float  # seconds to hold a newly published version


@dataclass(frozen=True, slots=True)
class WorkerProfile:
    """One rollout worker as the scheduler sees it; built from the workers table.

    `mu`, `t_gen_s` and `t_bcast_s` are the defaults; `perf_by_job` overrides them for jobs the
    worker has been measured on.
    """

    worker_id: str
    price_per_h: float
    vram_gb: float
    backends: frozenset[str]
    mu: float
    t_gen_s: float
    t_bcast_s: float
    alive: bool = True
    perf_by_job: Mapping[str, WorkerPerf] = field(default_factory=dict)

    def perf_for(self, job_id: str) -> WorkerPerf:
        perf = self.perf_by_job.get(job_id)
        return perf if perf is not None else WorkerPerf(self.mu, self.t_gen_s, self.t_bcast_s)

    def mu_for(self, job_id: str) -> float:
        """perf_for(job_id).mu, without building the perf (the re-solve triggers read it for every worker)."""
        perf = self.perf_by_job.get(job_id)
        return perf.mu if perf is not None else self.mu


@dataclass(frozen=True, slots=True)
class JobProfile:
    """One running job as the scheduler sees it; built from the jobs table plus learner metrics."""

    job_id: str
    rollouts_per_step: int  # R
    t_train_s: float  # T_train
    staleness: int  # S
    publish_period: int = 1  # κ
    headroom: float = DEFAULT_HEADROOM  # h
    vram_need_gb: float = 0.0
    backends: frozenset[str] = frozenset()  # accepted generation backends; empty accepts any
    priority: int = 0  # higher first
    submitted_at: float = 0.0  # earlier first among equal priorities
    max_usd_per_group: float | None = None  # the most a worker may cost a group (its price / 3600 / μ); None: any


@dataclass(frozen=True, slots=True)
class Qualification:
    """Whether a worker may serve a job, what it misses if not, the one-line reason, and what it contributes."""

    ok: bool
    kind: Miss | None  # None when ok
    reason: str
    perf: WorkerPerf
    latency_s: float  # T_bcast + T_gen
    slack_s: float
    share: float  # admissible share u
    mu: float  # u · μ, what counts towards the throughput rule


def validate_job(job: JobProfile) -> list[str]:
    """Problems that make the rule meaningless for this job (empty when the job is sound)."""
    problems = []
    if job.rollouts_per_step < 1:
        problems.append(f"rollouts_per_step must be ≥ 1, got {job.rollouts_per_step}")
    if not job.t_train_s > 0:
        problems.append(f"t_train_s must be > 0, got {job.t_train_s}")
    if job.staleness < 0:
        problems.append(f"staleness S must be ≥ 0, got {job.staleness}")
    if job.publish_period < 1:
        problems.append(f"publish period κ must be ≥ 1, got {job.publish_period}")
    elif job.publish_period > max_publish_period(job.staleness):
        problems.append(
            f"publish period κ={job.publish_period} exceeds S + 1 = {job.staleness + 1}: "
            "no worker can deliver admissible rollouts"
        )
    if job.headroom < 0:
        problems.append(f"headroom must be ≥ 0, got {job.headroom}")
    return problems


def waits_each_window(job: JobProfile) -> bool:
    """No slack (S − κ + 1 = 0): the learner waits for the newest version's rollouts once per window."""
    return slack_steps(job.staleness, job.publish_period) == 0


def required_throughput(job: JobProfile) -> float:
    """(1 + h) · R / T_train, in rollout groups per second."""
    return (1.0 + job.headroom) * job.rollouts_per_step / job.t_train_s


def freshness_slack_s(job: JobProfile) -> float:
    """(S − κ + 1) · T_train; T_train in windowed-synchronous mode (see the module docstring)."""
    if waits_each_window(job):
        return job.t_train_s
    return slack_steps(job.staleness, job.publish_period) * job.t_train_s


def hard_constraint_violation(
    worker: WorkerProfile, job: JobProfile, perf: WorkerPerf | None = None
) -> tuple[Miss, str] | None:
    """Which hard constraint keeps the worker from running the job at all and why, or None; `perf` is
    the worker's for the job when the caller has it already."""
    if not worker.alive:
        return Miss.liveness, "not alive"
    if worker.vram_gb < job.vram_need_gb:
        return Miss.vram, f"VRAM {worker.vram_gb:g} GiB < need {job.vram_need_gb:g} GiB"
    if job.backends and not (worker.backends & job.backends):
        have = ",".join(sorted(worker.backends)) or "none"
        need = ",".join(sorted(job.backends))
        return Miss.backend, f"backend {have} not supported (job needs {need})"
    perf = perf or worker.perf_for(job.job_id)
    if not perf.mu > 0:
        return Miss.throughput, "no measured throughput"
    own = max(worker.mu, perf.mu)  # its own rate (measured, or claimed on trial), not a trial's share of the need
    cost = worker.price_per_h / 3600 / own
    if job.max_usd_per_group is not None and cost > job.max_usd_per_group:
        return Miss.price, (f"${cost:.4g} a group (${worker.price_per_h:g}/h at {own:.3g} groups/s) > the job's "
                            f"workers.max_usd_per_group ${job.max_usd_per_group:g}")
    return None


def admissible_share(perf: WorkerPerf, job: JobProfile) -> float:
    """u: the share of a worker's generation that is still admissible when the learner gets to
    it (module docstring). 1 in windowed-synchronous mode, where the learner waits instead."""
    if waits_each_window(job):
        return 1.0
    window = job.staleness * job.t_train_s - (perf.t_bcast_s + perf.t_gen_s)
    if window < 0:
        return 0.0
    if perf.t_gen_s <= 0:
        return 1.0
    groups = math.floor(window / perf.t_gen_s) + 1
    return min(1.0, groups * perf.t_gen_s / (job.publish_period * job.t_train_s))


def qualify(worker: WorkerProfile, job: JobProfile) -> Qualification:
    """Hard constraints, then freshness; with the worker's admissible throughput u·μ."""
    perf = worker.perf_for(job.job_id)
    latency = perf.t_bcast_s + perf.t_gen_s
    slack = freshness_slack_s(job)
    share = admissible_share(perf, job)
    hard = hard_constraint_violation(worker, job, perf)
    if hard is not None:
        return Qualification(False, *hard, perf, latency, slack, share, 0.0)
    if latency > slack:
        reason = f"T_bcast+T_gen {latency:.1f}s > slack {slack:.1f}s"
        return Qualification(False, Miss.freshness, reason, perf, latency, slack, share, 0.0)
    reason = f"T_bcast+T_gen {latency:.1f}s ≤ slack {slack:.1f}s"
    return Qualification(True, None, reason, perf, latency, slack, share, share * perf.mu)


def throughput(workers: Iterable[WorkerProfile], job: JobProfile) -> float:
    """Σ u_i·μ_i over the workers that qualify for the job (the others contribute nothing usable)."""
    return sum(q.mu for q in (qualify(w, job) for w in workers) if q.ok)


def meets_throughput(workers: Iterable[WorkerProfile], job: JobProfile) -> bool:
    return throughput(workers, job) >= required_throughput(job) * (1 - 1e-9)


def predict_utilisation(job: JobProfile, workers: Iterable[WorkerProfile]) -> float:
    """Steady-state learner busy / wall for this set (pipeline fill at the start not included).

    With slack (κ ≤ S): a step lasts max(T_train, R / Σ u·μ), so the utilisation is
    min(1, Σ u·μ · T_train / R) over qualifying workers.
    Windowed-synchronous (κ = S + 1): κ·T_train / (κ·T_train + max T_bcast + max(max T_gen, R / Σμ)).
    """
    if job.rollouts_per_step <= 0:
        return 1.0  # nothing to wait for
    fresh = [q for q in (qualify(w, job) for w in workers) if q.ok]
    total_mu = sum(q.mu for q in fresh)
    if total_mu <= 0:
        return 0.0
    gen_phase = job.rollouts_per_step / total_mu
    if not waits_each_window(job):
        return min(1.0, job.t_train_s / gen_phase)
    wait = max(q.perf.t_bcast_s for q in fresh) + max(max(q.perf.t_gen_s for q in fresh), gen_phase)
    window = job.publish_period * job.t_train_s
    return window / (window + wait)


def estimate_bcast_s(
    model_bytes: float,
    down_bps: ArrayLike,
    relay_bps: ArrayLike,
    depth: ArrayLike,
    chunk_bytes: float,
    hop_latency_s: float = 0.0,
) -> Any:
    """T_bcast of a pipelined relay: M/B + depth·(chunk/B + hop latency), B = min(own downlink,
    the rate its parent can give it); infinite when B ≤ 0. Bandwidths in bytes per second. Numbers give
    a float; arrays (one entry per worker) an array, so a whole fleet is estimated in one call."""
    rate = np.minimum(down_bps, relay_bps)
    with np.errstate(divide="ignore"):
        t = np.where(rate > 0, model_bytes / rate + depth * (chunk_bytes / rate + hop_latency_s), np.inf)
    return t if t.ndim else float(t)


def sort_jobs(jobs: Iterable[JobProfile]) -> list[JobProfile]:
    """Priority order: higher priority first, then earlier submission, then id."""
    return sorted(jobs, key=lambda j: (-j.priority, j.submitted_at, j.job_id))
