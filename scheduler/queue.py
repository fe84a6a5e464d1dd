"""Which jobs get a learner: slots on the learner hosts, the owners' quotas, and the queue's order.

Each tick, jobs whose learner is alive keep their slots. The others that want one — queued jobs, and
running jobs whose learner died (their relaunch goes first) — are taken by priority, then age, into
free slots on one host (placement.py: N slots for an N-GPU learner, GPUs that hold its memory need),
skipping a job whose owner is at their concurrent-jobs quota; each left waiting gets
its place in line and the reason in `status_reason`. An owner whose spending over the last 24 hours
reached `max_usd_per_day` (jobs and Tinker usage together) has their queued and running jobs paused (cause
"quota") and queued again once the rolling day's spending falls below it; their Tinker requests are refused
meanwhile (api/tinker/queueing.py).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from echo2.protocol import JobStatus, PauseCause
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.models import Job, User
from api.services.jobs import pause_job, resume_job
from api.services.ledger import spent_today

from .placement import Line, Placement


def apply_daily_quotas(db: Session, jobs: list[Job], now: datetime) -> None:
    """Pause the queued and running jobs of owners over their daily quota; resume the ones it paused once allowed."""
    owners = {j.owner_id for j in jobs}
    limits = dict(db.execute(select(User.id, User.max_usd_per_day).where(
        User.id.in_(owners), User.max_usd_per_day.is_not(None))).all()) if owners else {}
    for owner, limit in limits.items():
        spent = spent_today(db, owner, now)
        for job in (j for j in jobs if j.owner_id == owner):
            if spent >= limit and job.status in (JobStatus.queued, JobStatus.running):
                pause_job(db, job, PauseCause.quota, f"your daily quota of ${limit:.2f} is spent (${spent:.2f} in "
                          "the last 24 h); the job resumes by itself as the day's spending rolls off")
            elif spent < limit and job.paused_for is PauseCause.quota:
                resume_job(job)
    for job in jobs:  # an owner whose quota was lifted
        if job.paused_for is PauseCause.quota and job.owner_id not in limits:
            resume_job(job)


def admit(db: Session, waiting: list[Job], line: Line, launch: Callable[[Job, Placement], bool]) -> None:
    """Launch waiting jobs into free slots in order (placement.py); number the rest and say what they wait
    for. `launch` returns False when the job did not get a learner after all (it failed its crash loop)."""
    limits = dict(db.execute(select(User.id, User.max_concurrent_jobs).where(
        User.id.in_({j.owner_id for j in waiting}), User.max_concurrent_jobs.is_not(None))).all()) \
        if waiting else {}
    position = 0
    for job in sorted(waiting, key=_order):
        limit = limits.get(job.owner_id)
        if limit is not None and line.holders[job.owner_id] >= limit:
            why = (f"your quota allows {limit} job{'s' if limit != 1 else ''} at a time "
                   f"({line.holders[job.owner_id]} running)")
        elif (placement := line.place(job)) is None:
            why = line.why_not(job)
        else:
            if launch(job, placement):
                line.holders[job.owner_id] += 1
                line.take(placement)
                if job.status == JobStatus.queued:
                    job.status_reason = "its learner is starting"
            job.queue_position = None
            continue
        position += 1
        job.queue_position = position
        if job.status == JobStatus.queued:
            job.status_reason = f"waiting for a learner, {_ordinal(position)} in line: {why}"


def _order(job: Job) -> tuple[bool, int, datetime]:
    """Relaunches of running jobs first, then by priority, then the oldest."""
    return job.status != JobStatus.running, -int(job.spec.get("priority", 0)), job.created_at


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
