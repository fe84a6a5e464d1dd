"""A job's learner utilisation and waste: what its learner did with its time, and what became of every
group its workers generated."""

from __future__ import annotations

from echo2.protocol import EvalRead, Fault, JobReport, MismatchStats, RejectKind, RolloutCounts, RolloutStatus
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..models import Audit, Job, Rollout, StepMetric
from . import evals

STALE = (RejectKind.stale_at_submit, RejectKind.stale_at_claim)


def job_report(db: Session, job: Job) -> JobReport:
    by_status = dict(db.execute(select(Rollout.status, func.count()).where(Rollout.job_id == job.id)
                                .group_by(Rollout.status)).all())
    rejected = dict(db.execute(
        select(Rollout.reject_kind, func.count()).where(Rollout.job_id == job.id, Rollout.reject_kind.is_not(None))
        .group_by(Rollout.reject_kind)).all())
    generated = sum(by_status.values())
    # Once the job ended nothing waits: what was accepted and never trained is unused (counted as wasted).
    untrained = by_status.get(RolloutStatus.accepted, 0) + by_status.get(RolloutStatus.claimed, 0)
    waiting, unused = (0, untrained) if job.status.is_terminal() else (untrained, 0)
    audits, failed = db.execute(select(func.count(), func.count().filter(Audit.passed.is_(False)))
                                .where(Audit.job_id == job.id)).one()
    audit_s = db.scalar(select(func.coalesce(func.sum(StepMetric.audit_s), 0.0)).where(StepMetric.job_id == job.id))
    wasted = sum(n for kind, n in rejected.items() if kind.fault() is not Fault.worker) + unused
    return JobReport(
        job_id=job.id, step=job.step, learner_busy_s=job.learner_busy_s, learner_wall_s=job.learner_wall_s,
        learner_idle_s=max(0.0, job.learner_wall_s - job.learner_busy_s),
        learner_utilization=job.learner_busy_s / job.learner_wall_s if job.learner_wall_s > 0 else None,
        rollouts=RolloutCounts(generated=generated, waiting=waiting, unused=unused,
                               trained=by_status.get(RolloutStatus.trained, 0), rejected=rejected),
        stale_fraction=sum(rejected.get(k, 0) for k in STALE) / generated if generated else None,
        wasted_fraction=wasted / generated if generated else None,
        audits=audits, audits_failed=failed, audit_s=float(audit_s or 0.0), estimate_usd=job.estimate_usd,
        mismatch=_mismatch(db, job),
        cost_usd=job.learner_usd + job.workers_usd, **_evals(db, job))


def _evals(db: Session, job: Job) -> dict[str, EvalRead | None]:
    """Held-out accuracy of the base model and of the newest evaluated version."""
    measured = evals.reads(db, job.id)
    before = next((e for e in measured if e.step == 0), None)
    return {"eval_before": before, "eval_after": measured[-1] if measured and measured[-1] is not before else None}


MEANS = ("kl", "ess", "clipped", "masked")


def _mismatch(db: Session, job: Job) -> list[MismatchStats]:
    """Every step's mismatch rows (StepMetric.mismatch) pooled per staleness, token-weighted."""
    pooled: dict[int, dict[str, float]] = {}
    for rows in db.scalars(select(StepMetric.mismatch).where(StepMetric.job_id == job.id)):
        for row in rows:
            acc = pooled.setdefault(row["staleness"], dict.fromkeys(("tokens", *MEANS), 0.0))
            acc["tokens"] += row["tokens"]
            for key in MEANS:
                acc[key] += row[key] * row["tokens"]
    return [MismatchStats(staleness=s, tokens=int(acc["tokens"]),
                          **{k: acc[k] / acc["tokens"] if acc["tokens"] else 0.0 for k in MEANS})
            for s, acc in sorted(pooled.items(), key=lambda kv: (kv[0] < 0, kv[0]))]
