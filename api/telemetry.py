"""Prometheus metrics: request counts/latency per route, and fleet, job and worker series read from the
database at scrape time (so every API replica reports the same truth).

Label cardinality stays bounded: per-job series cover running and paused jobs only, per-worker series
the workers not deregistered. Totals kept in the database (tokens, cost, groups, pay) are counters."""

from __future__ import annotations

import time
from collections.abc import Iterator

from echo2.protocol import JobStatus, WorkerStatus
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from sqlalchemy import func, select
from sqlalchemy.orm import Session, load_only
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .db import Database
from .models import EvalResult, Job, Rollout, StepMetric, WeightVersion, Worker
from .services import dissemination
from .services.jobs import spec_of

LIVE_JOBS = (JobStatus.running, JobStatus.paused)  # jobs with a training run to follow
DISSEMINATION_LOOKBACK = 4  # newest versions searched for the newest one every targeted worker holds


class _DatabaseCollector(Collector):
    def __init__(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterator[Metric]:
        with self.db.session() as s:
            yield _family(s, "echo2_jobs", "Jobs by status", Job.status)
            yield _family(s, "echo2_workers", "Workers by status", Worker.status)
            yield _family(s, "echo2_rollouts", "Rollout groups by status", Rollout.status)
            yield _held_out(s)
            jobs = list(s.scalars(select(Job).where(Job.status.in_(LIVE_JOBS)).order_by(Job.id)))
            yield from _job_families(jobs)
            yield _trained_tokens(s, [j.id for j in jobs])
            yield _staleness(s, jobs)
            yield from _mismatch(s, [j.id for j in jobs])
            yield _workers_active(s, [j.id for j in jobs])
            yield _dissemination(s, [j.id for j in jobs])
            yield from _worker_families(s)


def _job_families(jobs: list[Job]) -> Iterator[Metric]:
    step = GaugeMetricFamily("echo2_job_step", "Learner steps the job has committed", labels=["job"])
    reward = GaugeMetricFamily("echo2_job_reward_mean", "Mean reward of the newest committed step", labels=["job"])
    util = GaugeMetricFamily("echo2_job_learner_utilization_ratio", "Share of the learner's wall time spent "
                             "training (busy_s / wall_s, from its heartbeats)", labels=["job"])
    cost = CounterMetricFamily("echo2_job_cost_usd", "Spent so far: kind=learner (reserved learner time) or "
                               "kind=workers (paid rollouts)", labels=["job", "kind"])
    for job in jobs:
        step.add_metric([job.id], job.step)
        if job.reward_mean is not None:
            reward.add_metric([job.id], job.reward_mean)
        if job.learner_wall_s > 0:
            util.add_metric([job.id], job.learner_busy_s / job.learner_wall_s)
        cost.add_metric([job.id, "learner"], job.learner_usd)
        cost.add_metric([job.id, "workers"], job.workers_usd)
    yield from (step, reward, util, cost)


def _trained_tokens(session: Session, job_ids: list[str]) -> CounterMetricFamily:
    family = CounterMetricFamily("echo2_job_trained_tokens", "Completion tokens the learner trained on (the "
                                 "step reports' token counts); rate() of it is trained tokens per second",
                                 labels=["job"])
    for job_id, tokens in session.execute(select(StepMetric.job_id, func.sum(StepMetric.tokens))
                                          .where(StepMetric.job_id.in_(job_ids)).group_by(StepMetric.job_id)):
        family.add_metric([job_id], tokens)
    return family


def _staleness(session: Session, jobs: list[Job]) -> HistogramMetricFamily:
    """Summed from the steps' reports (StepMetric.staleness_hist: index k = groups of staleness k)."""
    family = HistogramMetricFamily(
        "echo2_job_rollout_staleness_steps", "Staleness t - x of the rollout groups the learner trained, in "
        "steps. A histogram, not a counter per value, so PromQL gets the mean (_sum / _count) and quantiles; its "
        "buckets are the admissible values le=0..S, so le=k minus le=k-1 is still the exact count at k",
        labels=["job"])
    counts: dict[str, list[int]] = {job.id: [] for job in jobs}
    for job_id, hist in session.execute(select(StepMetric.job_id, StepMetric.staleness_hist)
                                        .where(StepMetric.job_id.in_(counts))):
        total = counts[job_id]
        total.extend([0] * (len(hist) - len(total)))
        for k, n in enumerate(hist):
            total[k] += n
    for job in jobs:
        total, cumulative, buckets = counts[job.id], 0, []
        for k in range(spec_of(job).staleness + 1):
            cumulative += total[k] if k < len(total) else 0
            buckets.append((floatToGoString(k), cumulative))
        buckets.append(("+Inf", sum(total)))
        family.add_metric([job.id], buckets, sum_value=sum(k * n for k, n in enumerate(total)))
    return family


MISMATCH_SERIES = (  # (name, field of echo2.protocol.MismatchStats, help)
    ("echo2_job_mismatch_kl", "kl", "KL(behaviour || learner) per token (k3) over the newest step's trained tokens"),
    ("echo2_job_ess", "ess", "Effective sample size of the newest step's importance weights, as a share (1: all "
     "equal)"),
    ("echo2_job_is_clipped_ratio", "clipped", "Share of the newest step's tokens whose importance weight was "
     "truncated (tis) or capped (ratio_cap)"),
    ("echo2_job_is_masked_ratio", "masked", "Share of the newest step's tokens given weight 0 by the correction "
     "(mis, icepop) or outside the replayed sampler support"),
)


def _mismatch(session: Session, job_ids: list[str]) -> Iterator[GaugeMetricFamily]:
    """The newest step's mismatch between behaviour and learner (StepMetric.mismatch), by staleness t - x
    ("all": every token of the step)."""
    families = [GaugeMetricFamily(name, doc + "; staleness=\"all\" for all of them", labels=["job", "staleness"])
                for name, _, doc in MISMATCH_SERIES]
    newest = (select(StepMetric.job_id, func.max(StepMetric.step).label("step"))
              .where(StepMetric.job_id.in_(job_ids)).group_by(StepMetric.job_id).subquery())
    on_newest = (StepMetric.job_id == newest.c.job_id) & (StepMetric.step == newest.c.step)
    rows = session.execute(select(StepMetric.job_id, StepMetric.mismatch).join(newest, on_newest)
                           .order_by(StepMetric.job_id))
    for job_id, mismatch in rows:
        for bucket in mismatch:
            label = "all" if bucket["staleness"] < 0 else str(bucket["staleness"])
            for family, (_, field, _) in zip(families, MISMATCH_SERIES, strict=True):
                family.add_metric([job_id, label], bucket[field])
    yield from families


def _workers_active(session: Session, job_ids: list[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily("echo2_job_workers_active", "Workers the scheduler has active on the job (not "
                               "offline): those each new version is sent to", labels=["job"])
    active = dict(session.execute(select(Worker.job_id, func.count()).where(
        Worker.job_id.in_(job_ids), dissemination.ACTIVE).group_by(Worker.job_id)).all())
    for job_id in job_ids:
        family.add_metric([job_id], active.get(job_id, 0))
    return family


def _dissemination(session: Session, job_ids: list[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily("echo2_job_dissemination_seconds", "How long the newest weight version that "
                               "reached every targeted worker took, from its announcement to the last one's "
                               "first heartbeat holding it", labels=["job"])
    for job_id in job_ids:
        rows = list(session.scalars(select(WeightVersion).where(WeightVersion.job_id == job_id)
                                    .options(load_only(WeightVersion.targets, WeightVersion.created_at))
                                    .order_by(WeightVersion.version.desc()).limit(DISSEMINATION_LOOKBACK)))
        done = [s for s in dissemination.seconds(session, rows).values() if s is not None]
        if done:
            family.add_metric([job_id], done[0])
    return family


def _worker_families(session: Session) -> Iterator[Metric]:
    info = InfoMetricFamily("echo2_worker", "Each worker's status, trust and job (empty when idle)",
                            labels=["worker"])
    accepted = CounterMetricFamily("echo2_worker_accepted_groups", "Rollout groups of the worker accepted at "
                                   "submission", labels=["worker"])
    rejected = CounterMetricFamily("echo2_worker_rejected_groups", "Rollout groups of the worker rejected at "
                                   "submission (stale, malformed) or refused by the learner", labels=["worker"])
    earned = CounterMetricFamily("echo2_worker_earned_usd", "Paid to the worker so far", labels=["worker"])
    mu = GaugeMetricFamily("echo2_worker_mu_groups_per_second", "μ the scheduler activated the worker at "
                           "(groups/s measured from its deliveries; a new worker's claim, capped, until it "
                           "delivers): what its pay is measured against", labels=["worker"])
    for w in session.execute(select(Worker.id, Worker.status, Worker.trust, Worker.job_id, Worker.accepted_rollouts,
                                    Worker.rejected_rollouts, Worker.earned_usd, Worker.activated_mu)
                             .where(Worker.status != WorkerStatus.deregistered).order_by(Worker.id)):
        info.add_metric([w.id], {"status": w.status, "trust": w.trust, "job": w.job_id or ""})
        accepted.add_metric([w.id], w.accepted_rollouts)
        rejected.add_metric([w.id], w.rejected_rollouts)
        earned.add_metric([w.id], w.earned_usd)
        if w.activated_mu is not None:
            mu.add_metric([w.id], w.activated_mu)
    yield from (info, accepted, rejected, earned, mu)


def _held_out(session) -> GaugeMetricFamily:  # type: ignore[no-untyped-def]
    """The latest held-out accuracy of every running job (its eval curve's last point)."""
    family = GaugeMetricFamily("echo2_job_heldout_accuracy", "Held-out accuracy of the newest evaluated version "
                               "(prompts the job never trains on)", labels=["job", "decoding"])
    latest = select(EvalResult.job_id, func.max(EvalResult.step).label("step")).group_by(EvalResult.job_id).subquery()
    rows = session.execute(select(EvalResult).join(latest, (EvalResult.job_id == latest.c.job_id)
                                                   & (EvalResult.step == latest.c.step))
                           .join(Job, Job.id == EvalResult.job_id).where(Job.status == JobStatus.running))
    for (row,) in rows:
        for decoding, value in (("greedy", row.greedy_accuracy), ("sampled", row.sampled_accuracy)):
            if value is not None:
                family.add_metric([row.job_id, decoding], value)
    return family


def _family(session, name: str, doc: str, column) -> GaugeMetricFamily:  # type: ignore[no-untyped-def]
    family = GaugeMetricFamily(name, doc, labels=["status"])
    for status, count in session.execute(select(column, func.count()).group_by(column)):
        family.add_metric([status], count)
    return family


class Telemetry:
    def __init__(self, db: Database) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("echo2_http_requests", "HTTP requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("echo2_http_request_seconds", "HTTP request latency", ["method", "route"],
                                 registry=self.registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
        self.registry.register(_DatabaseCollector(db))


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, telemetry: Telemetry) -> None:
        self.app, self.t = app, telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.t.requests.labels(scope["method"], route, str(status)).inc()
            self.t.latency.labels(scope["method"], route).observe(time.perf_counter() - start)
