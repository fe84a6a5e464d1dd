"""Pay taken back from a worker caught forging.

A worker is paid for groups that were trained (scheduler/billing.py), before anyone can know whether its
unaudited groups were honest. Once it is quarantined or banned for what it sent, every payment it received
and still holds is reversed: per job, one `clawback` entry of the opposite amount naming the rollouts those
payments were for, so the job's ledger and the provider's statement both net to what the worker keeps:
nothing, for a worker shut out for forging. Its provider's earnings, the worker's and the job's cost go down
by as much (a provider's earnings may go below zero: it owes the difference). Payments are reversed once.

What it had not been paid yet is forfeited: its groups not paid for (trained or not) are settled by a $0.00
`forfeit` entry per job naming them, and its active time waiting for pay is dropped, so that nothing of it is
paid once a quarantine ends.
"""

from __future__ import annotations

from collections import defaultdict

from echo2.protocol import LedgerKind
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..models import Job, LedgerEntry, Provider, Rollout, Worker
from . import totals


def claw_back(db: Session, worker: Worker, reason: str) -> float:
    """Reverse every payment to `worker` not reversed yet; returns the amount taken back."""
    paid = list(db.scalars(select(LedgerEntry).where(LedgerEntry.worker_id == worker.id,
                                                     LedgerEntry.kind == LedgerKind.worker,
                                                     LedgerEntry.clawed_back_by.is_(None))
                           .with_for_update()))
    by_job: dict[str, list[LedgerEntry]] = defaultdict(list)
    for entry in paid:
        by_job[entry.job_id].append(entry)
    total = 0.0
    provider = db.get(Provider, worker.provider_id)
    for job_id, entries in by_job.items():
        amount = sum(e.amount_usd for e in entries)
        job = db.get(Job, job_id)
        reversal = LedgerEntry(job_id=job_id, kind=LedgerKind.clawback, worker_id=worker.id,
                               provider_id=worker.provider_id, amount_usd=-amount,
                               seconds=-sum(e.seconds for e in entries), groups=-sum(e.groups for e in entries),
                               rollout_ids=[r for e in entries for r in e.rollout_ids],
                               step=job.step if job is not None else None,
                               memo=f"clawed back {len(entries)} payments: {reason}"[:256])
        db.add(reversal)
        db.flush()
        for entry in entries:
            entry.clawed_back_by = reversal.id
        if job is not None:
            totals.add(db, Job.workers_usd, job.id, -amount)
        total += amount
    totals.add(db, Worker.earned_usd, worker.id, -total)
    if provider is not None:
        totals.add(db, Provider.earnings_usd, provider.id, -total)
    _forfeit(db, worker, reason)
    return total


def _forfeit(db: Session, worker: Worker, reason: str) -> None:
    """Settle the worker's unpaid groups with nothing, and drop its unpaid active time."""
    unpaid: dict[str, list[str]] = defaultdict(list)
    for job_id, rollout_id in db.execute(select(Rollout.job_id, Rollout.id).where(
            Rollout.worker_id == worker.id, Rollout.paid_entry_id.is_(None)).order_by(Rollout.created_at)):
        unpaid[job_id].append(rollout_id)
    for job_id, ids in unpaid.items():
        job = db.get(Job, job_id)
        entry = LedgerEntry(job_id=job_id, kind=LedgerKind.forfeit, worker_id=worker.id,
                            provider_id=worker.provider_id, amount_usd=0.0, seconds=0.0, groups=0, rollout_ids=ids,
                            step=job.step if job is not None else None,
                            memo=f"forfeited {len(ids)} unpaid groups: {reason}"[:256])
        db.add(entry)
        db.flush()
        db.execute(Rollout.__table__.update().where(Rollout.id.in_(ids)).values(paid_entry_id=entry.id))
    worker.unbilled = {}
