"""A job's cost before it runs, from what earlier jobs like it measured and the fleet as it is now.

    step  = max(T_train + overhead, R / Σ_{i∈A} μ_i)
    wall  = startup + max_steps · step
    cost  = learner price · wall + Σ_{i∈A} price_i · wall

Jobs like it: the same base model, LoRA or not, the same learner device and GPUs, and samples per step
(R·G) and max_new_tokens each within a factor of 2. From the later half of their latest steps (a job's
first steps warm up: allocators, caches, workers loading the model) come T_train (the median, scaled by
samples per step) and the learner's other seconds per step (the step period beyond T_train: publishing,
reporting, evaluating, waiting for rollouts); from those that succeeded, its seconds outside that pace
(billed learner time beyond steps × period: loading, the first version, warming up, the final
evaluation). With none, T_train is the scheduler's default and the rest is 0.

A is the set the capacity rule would activate for this job alone from the live fleet now (solver.decide
on capacity profiles). Each worker is counted at the rate it generated at on those jobs: the groups of its
completed leases over the time it held at least one, as the control plane saw it (while the learner sets
the pace a worker waits between leases, so its delivery rate alone would measure the learner, not the
worker); else at the rate it claims. The figures and the assumptions come back in words
(`JobEstimate.assumptions`).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from echo2.money import usd
from echo2.protocol import (
    EstimateWorker,
    JobEstimate,
    JobSpec,
    JobStatus,
    LearnerMemory,
    LeaseStatus,
    RejectKind,
    RolloutStatus,
    TrustState,
    WorkerStatus,
)
from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from planner.capacity import DEFAULT_T_TRAIN_S, JobProfile, WorkerProfile, qualify, required_throughput
from planner.decision import SolverConfig
from planner.solver import decide

from ..models import Job, Lease, LedgerEntry, Rollout, StepMetric, VersionHold, WeightVersion, Worker, utcnow
from ..settings import Settings
from .memory import computes_on_gpu, judge, shape_of

DEFAULT_MU = 1.0  # groups/s for a worker neither measured nor claiming a rate, as the scheduler's trial counts it
SIMILAR = 2.0  # "like it": samples per step and max_new_tokens within this factor
SCAN_JOBS = 500  # recent jobs looked through for ones like it
LIKE_JOBS = 10  # the most recent ones like it are used
STEPS = 400  # the latest steps of each, of which the later half is used
LEASES = 20_000  # the latest completed leases on them
HOLDS = 5000  # the latest version holds on them
WORKING = TrustState.working()
PAID_REJECTIONS = [k for k in RejectKind if k.paid()]


@dataclass
class _Learner:
    """The learner's seconds as jobs like this one measured them."""

    t_train_s: float
    t_train_source: str
    overhead_s: float = 0.0
    startup_s: float = 0.0
    note: str = "no learner time besides training is counted: no earlier job like this one to measure it on"


@dataclass
class _Past:
    """An earlier job like this one, and what the later half of its latest steps measured."""

    job: Job
    spec: JobSpec
    t_train_s: float  # median
    steps: int
    period_s: float | None  # wall seconds per step between the first and last of them (None with one)


@dataclass
class _Rate:
    """A worker on the jobs like this one: groups in its completed leases, the seconds it held at least one
    lease, and its generation and dissemination seconds."""

    groups: int = 0
    submitted: int = 0  # every group of its completed leases, useful or not: what its busy time made
    leases: int = 0
    busy_s: float = 0.0
    gen_total_s: float = 0.0
    bcast: list[float] = field(default_factory=list)

    @property
    def mu(self) -> float | None:
        return self.groups / self.busy_s if self.groups > 0 and self.busy_s > 0 else None

    @property
    def gen_s(self) -> float | None:
        """Seconds a group: what the worker said, or its busy time over the groups it made where that is longer
        (a worker that says it is faster than the control plane's clock saw it gains nothing by saying so)."""
        claimed = self.gen_total_s / self.groups if self.gen_total_s > 0 else 0.0
        measured = self.busy_s / self.submitted if self.submitted > 0 else 0.0
        return max(claimed, measured) or None


def estimate(db: Session, spec: JobSpec, settings: Settings, now: datetime | None = None) -> JobEstimate:
    now = now or utcnow()
    like = _history(db, _jobs_like(db, spec))
    learner = _learner(db, spec, like)
    # The hard constraints the scheduler will apply; a memory need not given is derived from a job's first
    # version, so one like it tells it best.
    memory = spec.workers.memory_gb or next((p.job.memory_need_gb for p in like if p.job.memory_need_gb), 0.0)
    job = JobProfile(job_id="estimate", rollouts_per_step=spec.grpo.prompts_per_step,
                     t_train_s=max(learner.t_train_s, 1e-3), staleness=spec.staleness,
                     publish_period=spec.publish_period, priority=spec.priority, vram_need_gb=memory,
                     backends=frozenset(b.value for b in spec.workers.backends),
                     max_usd_per_group=spec.workers.max_usd_per_group)
    workers = list(db.scalars(select(Worker).where(Worker.status.in_((WorkerStatus.idle, WorkerStatus.active)),
                                                   Worker.trust.in_(WORKING)).order_by(Worker.id)))
    rates = _rates(db, like)
    profiles = [_profile(w, rates[w.id]) for w in workers]
    decision = decide([job], profiles, now=now.timestamp(),
                      config=SolverConfig(method=settings.solver, min_dwell_s=settings.min_dwell_s))
    allocation = decision.jobs[0]
    by_id = {w.id: w for w in workers}
    chosen = [p for p in profiles if p.worker_id in allocation.worker_ids]
    named = [_named(by_id[p.worker_id], p, job, rates[p.worker_id]) for p in chosen]
    throughput = sum(w.mu for w in named)
    busy = learner.t_train_s + learner.overhead_s
    step_s = max(busy, job.rollouts_per_step / throughput) if throughput > 0 else busy
    wall_s = learner.startup_s + spec.max_steps * step_s
    learner_price = spec.learner.price_per_hour if spec.learner.price_per_hour is not None \
        else settings.learner_price_per_hour
    workers_price = sum(w.price_per_hour for w in named)
    learner_usd, workers_usd = learner_price * wall_s / 3600, workers_price * wall_s / 3600
    out = JobEstimate(
        t_train_s=learner.t_train_s, t_train_source=learner.t_train_source, step_overhead_s=learner.overhead_s,
        startup_s=learner.startup_s, rollouts_per_step=job.rollouts_per_step,
        required_throughput=required_throughput(job), throughput=throughput, workers=named,
        feasible=bool(named) and allocation.feasible, step_s=step_s, wall_s=wall_s,
        learner_price_per_hour=learner_price, workers_price_per_hour=workers_price, learner_usd=learner_usd,
        workers_usd=workers_usd, cost_usd=learner_usd + workers_usd, assumptions=[])
    out.assumptions = _assumptions(spec, learner, out, len(workers), allocation.reason)
    out.learner_memory, _ = judge(db, spec, shape_of(spec.base_model, settings))
    out.assumptions.append(_memory_words(spec, out.learner_memory))
    return out


# ---------------------------------------------------------------- the learner, from jobs like this one


def _jobs_like(db: Session, spec: JobSpec) -> list[tuple[Job, JobSpec]]:
    """The most recent jobs with steps that are like this one, newest first."""
    rows = db.scalars(select(Job).where(Job.step >= 1).order_by(Job.created_at.desc()).limit(SCAN_JOBS))
    like = []
    for job in rows:
        if job.spec.get("base_model") != spec.base_model:
            continue  # the cheap test first: most jobs differ here
        other = JobSpec.model_validate(job.spec)
        if _like(spec, other):
            like.append((job, other))
            if len(like) == LIKE_JOBS:
                break
    return like


def _like(spec: JobSpec, other: JobSpec) -> bool:
    same_learner = (spec.lora is None) == (other.lora is None) and spec.learner.gpus == other.learner.gpus \
        and spec.learner.device == other.learner.device
    return same_learner and _within(_samples(spec), _samples(other)) \
        and _within(spec.grpo.max_new_tokens, other.grpo.max_new_tokens)


def _samples(spec: JobSpec) -> int:
    return spec.grpo.prompts_per_step * spec.grpo.group_size


def _within(a: float, b: float) -> bool:
    return max(a, b) <= SIMILAR * min(a, b)


def _history(db: Session, like: list[tuple[Job, JobSpec]]) -> list[_Past]:
    out = []
    for job, spec in like:
        rows = db.execute(select(StepMetric.step, StepMetric.t_train_s, StepMetric.created_at)
                          .where(StepMetric.job_id == job.id).order_by(StepMetric.step.desc()).limit(STEPS)).all()
        rows = rows[:max(2, (len(rows) + 1) // 2)]  # newest first: the later half, warmed up
        if not rows:
            continue
        first, last = rows[-1], rows[0]
        period = (last.created_at - first.created_at).total_seconds() / (last.step - first.step) \
            if len(rows) > 1 else None
        out.append(_Past(job, spec, statistics.median(r.t_train_s for r in rows), len(rows), period))
    return out


def _learner(db: Session, spec: JobSpec, like: list[_Past]) -> _Learner:
    if not like:
        return _Learner(DEFAULT_T_TRAIN_S, "the scheduler's default: no earlier job like this one has run")
    billed = _billed_learner_s(db, [p.job.id for p in like if p.job.status == JobStatus.succeeded])
    timed = [(p, p.period_s) for p in like if p.period_s is not None]
    overheads = [max(0.0, period - p.t_train_s) for p, period in timed]
    startups = [max(0.0, billed[p.job.id] - p.job.step * period) for p, period in timed if p.job.id in billed]
    source = (f"the median of {sum(p.steps for p in like)} warmed-up steps of {len(like)} earlier job(s) like "
              f"this one, scaled to {_samples(spec)} samples per step")
    learner = _Learner(statistics.median(p.t_train_s * _samples(spec) / _samples(p.spec) for p in like), source)
    if overheads:
        learner.overhead_s = statistics.median(overheads)
        learner.startup_s = statistics.median(startups) if startups else 0.0
        learner.note = (f"the learner spends {learner.overhead_s:.2f} s per step besides training (publishing, "
                        f"reporting, evaluating, waiting) and {learner.startup_s:.0f} s beyond that pace (starting, "
                        f"warming up, finishing), as on those jobs"
                        + ("" if startups else " (none of them finished: the latter is not counted)"))
    return learner


def _billed_learner_s(db: Session, job_ids: list[str]) -> dict[str, float]:
    if not job_ids:
        return {}
    rows = db.execute(select(LedgerEntry.job_id, func.sum(LedgerEntry.seconds))
                      .where(LedgerEntry.job_id.in_(job_ids), LedgerEntry.kind == "learner")
                      .group_by(LedgerEntry.job_id))
    return {job_id: float(seconds or 0.0) for job_id, seconds in rows}


# ---------------------------------------------------------------- the workers, measured on those jobs


def _rates(db: Session, like: list[_Past]) -> dict[str, _Rate]:
    """Per worker, on these jobs: the groups of use in its completed leases (accepted; of those rejected, only
    the ones a worker is paid for, not its own faults nor those that came too late) over the time it held
    at least one (a prefetched lease overlaps the one being generated: the union is its busy time), their
    generation time a group (_Rate.gen_s), and its dissemination times."""
    rates: dict[str, _Rate] = defaultdict(_Rate)
    job_ids = [p.job.id for p in like]
    if not job_ids:
        return rates
    useful = (Rollout.status != RolloutStatus.rejected) | Rollout.reject_kind.in_(PAID_REJECTIONS)
    rows = db.execute(select(Lease.worker_id, Lease.created_at, Lease.finished_at, func.count().filter(useful),
                             func.sum(Rollout.gen_seconds).filter(useful), func.count())
                      .join(Rollout, Rollout.lease_id == Lease.id)  # a completed lease answered every prompt
                      .where(Lease.job_id.in_(job_ids), Lease.status == LeaseStatus.completed)
                      .group_by(Lease.id, Lease.worker_id, Lease.created_at, Lease.finished_at)
                      .order_by(Lease.created_at.desc()).limit(LEASES)).all()
    by_worker: dict[str, list[tuple[datetime, datetime]]] = defaultdict(list)
    for worker_id, start, end, groups, gen, submitted in rows:
        rate = rates[worker_id]
        rate.groups += groups
        rate.submitted += submitted
        rate.leases += 1
        rate.gen_total_s += float(gen or 0.0)
        by_worker[worker_id].append((start, end))
    for worker_id, spans in by_worker.items():
        rates[worker_id].busy_s = busy_seconds(spans)
    holds = db.execute(select(VersionHold.worker_id, VersionHold.held_at, WeightVersion.created_at)
                       .join(WeightVersion, and_(WeightVersion.job_id == VersionHold.job_id,
                                                 WeightVersion.version == VersionHold.version))
                       .where(VersionHold.job_id.in_(job_ids)).order_by(VersionHold.held_at.desc()).limit(HOLDS))
    for worker_id, held, announced in holds:
        rates[worker_id].bcast.append(max(0.0, (held - announced).total_seconds()))
    return rates


def busy_seconds(spans: list[tuple[datetime, datetime]]) -> float:
    """Seconds covered by at least one of the spans (a worker's leases, from grant to answer: it books its next
    lease while it generates, so they overlap)."""
    total, reach = 0.0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total, reach = total + (end - start).total_seconds(), end
        elif end > reach:
            total, reach = total + (end - reach).total_seconds(), end
    return total


def _profile(worker: Worker, rate: _Rate) -> WorkerProfile:
    mu = rate.mu or worker.rollouts_per_s or DEFAULT_MU
    t_gen = rate.gen_s or 1.0 / mu
    t_bcast = statistics.fmean(rate.bcast) if rate.bcast else 0.0
    return WorkerProfile(worker_id=worker.id, price_per_h=worker.price_per_hour, vram_gb=worker.vram_gb,
                         backends=frozenset(worker.backends), mu=mu, t_gen_s=t_gen, t_bcast_s=t_bcast)


def _named(worker: Worker, profile: WorkerProfile, job: JobProfile, rate: _Rate) -> EstimateWorker:
    q = qualify(profile, job)
    if rate.mu is not None:
        source = f"measured: {rate.groups} groups in {rate.leases} leases on earlier jobs like this one"
    elif worker.rollouts_per_s:
        source = "claimed at registration (not measured on a job like this one yet)"
    else:
        source = "assumed (neither measured nor claimed), as the scheduler's trial counts it"
    # μ as measured: groups that were of use, so the admissible share u (capacity.py) is in it already.
    return EstimateWorker(worker_id=worker.id, name=worker.name, price_per_hour=worker.price_per_hour,
                          mu=profile.mu, mu_source=source, fresh=q.ok)


# ---------------------------------------------------------------- in words


def _assumptions(spec: JobSpec, learner: _Learner, e: JobEstimate, live: int, reason: str) -> list[str]:
    out = [f"T_train {e.t_train_s:.2f} s per step: {e.t_train_source}", learner.note]
    if e.workers:
        names = ", ".join(f"{w.name} (${w.price_per_hour:.2f}/h, {w.mu:.3g} groups/s)" for w in e.workers)
        out.append(f"the capacity rule would activate {len(e.workers)} of the {live} live workers now: {names}; "
                   f"{reason}")
        out.append(f"a step takes max(T_train + overhead {e.t_train_s + e.step_overhead_s:.2f} s, R / Σμ "
                   f"{e.rollouts_per_step / e.throughput:.2f} s) = {e.step_s:.2f} s")
        out.append("workers are paid at today's prices for the whole wall time; the fleet, its prices and "
                   "other jobs competing for it may change before and while the job runs")
    else:
        out.append(f"no worker is available for it now ({live} live; {reason}): the estimate covers the learner "
                   "only, and the job would wait for workers")
    if spec.budget_usd is not None and e.cost_usd > spec.budget_usd:
        steps = round(spec.max_steps * spec.budget_usd / e.cost_usd)
        out.append(f"the budget of {usd(spec.budget_usd)} is spent after about {steps} of {spec.max_steps} steps")
    return out


def _memory_words(spec: JobSpec, m: LearnerMemory | None) -> str:
    if m is None:
        return (f"its learner's memory is not estimated: the config of {spec.base_model} is not at hand on the "
                "control plane (a built-in, a folder it sees, or the Hugging Face cache)")
    words = (f"each of its {m.gpus} learner GPU(s) needs about {m.per_gpu_gib:g} GiB (weights {m.weights_gib:g}, "
             f"gradients {m.gradients_gib:g}, AdamW {m.optimizer_gib:g}, reference {m.reference_gib:g}, FSDP gathers "
             f"{m.gathered_gib:g}, activations {m.activations_gib:g}, runtime {m.runtime_gib:g} GiB; {m.source})")
    if m.fits is not None:
        return words + f"; the largest registered learner host's GPUs hold {m.largest_gpu_gib:g} GiB"
    if computes_on_gpu(spec):
        return words + ("; no learner host with GPUs is registered yet, so whether one can hold it is not known: "
                        "it waits in line until one that can is up")
    return words + " when it runs on a GPU (on a CPU learner host, in its memory)"
