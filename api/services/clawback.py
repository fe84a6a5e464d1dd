"""Pay taken back from a worker caught forging.

A worker is paid for groups that were trained (scheduler/billing.py), before anyone can know whether its
unaudited groups were honest. Once it is quarantined or banned for what it sent, every payment it received
and still holds is reversed: per job, one `clawback` entry of the opposite amount naming the rollouts those
payments were for, so the job's ledger and the provider's statement both net to what the worker keeps:
nothing, for a worker shut out for forging. Its provider's earnings, the worker's and the job's cost go down
by as much (a provider's earnings may go below zero: it owes the difference). Payments are reversed once.
"""

from __future__ import annotations

from collections import defaultdict

from echo2.protocol import LedgerKind
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..models import Job, LedgerEntry, Provider, Worker


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
            job.workers_usd -= amount
        total += amount
    worker.earned_usd -= total
    if provider is not None:
        provider.earnings_usd -= total
    return total
