"""The cost ledger as its readers see it: a provider's statement and a job's ledger. Entries come a page at
a time; totals are summed by the database over every entry in range, so they hold whatever the page."""

from __future__ import annotations

import csv
import io
from datetime import datetime, timedelta
from typing import Any

from echo2.protocol import JobLedger, LedgerEntryRead, LedgerTotal, ProviderStatement
from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session, defer

from ..models import Job, LedgerEntry, Provider
from ..tinker.models import TinkerUsage
from .jobs import job_read

DAY = timedelta(days=1)


def spent_today(db: Session, owner_id: str, now: datetime) -> float:
    """What the user spent in the 24 hours before `now`: its jobs' ledger entries and its Tinker usage."""
    jobs = db.scalar(select(func.coalesce(func.sum(LedgerEntry.amount_usd), 0.0))
                     .join(Job, Job.id == LedgerEntry.job_id)
                     .where(Job.owner_id == owner_id, LedgerEntry.created_at >= now - DAY))
    tinker = db.scalar(select(func.coalesce(func.sum(TinkerUsage.amount_usd), 0.0))
                       .where(TinkerUsage.owner_id == owner_id, TinkerUsage.created_at >= now - DAY))
    return float(jobs) + float(tinker)

CSV_HEADER = ("time", "kind", "worker", "job", "step", "groups", "seconds", "amount_usd", "memo")


def statement(db: Session, provider: Provider, since: datetime | None, until: datetime | None, limit: int,
              offset: int) -> ProviderStatement:
    where = [LedgerEntry.provider_id == provider.id]
    if since is not None:
        where.append(LedgerEntry.created_at >= since)
    if until is not None:
        where.append(LedgerEntry.created_at < until)
    entries, total = _page(db, where, limit, offset)
    by_job = _totals(db, LedgerEntry.job_id, where)
    return ProviderStatement(
        provider_id=provider.id, since=since, until=until, entries=entries, total_entries=total,
        next_offset=next_offset(offset, len(entries), total), by_worker=_totals(db, LedgerEntry.worker_id, where),
        by_job=by_job, total_usd=sum(t.amount_usd for t in by_job), earnings_usd=provider.earnings_usd)


def job_ledger(db: Session, job: Job, limit: int, offset: int) -> JobLedger:
    where = [LedgerEntry.job_id == job.id]
    entries, total = _page(db, where, limit, offset)
    by_kind = _totals(db, LedgerEntry.kind, where)
    return JobLedger(job_id=job.id, entries=entries, total_entries=total,
                     next_offset=next_offset(offset, len(entries), total), by_kind=by_kind,
                     total_usd=sum(t.amount_usd for t in by_kind), cost=job_read(job).cost)


def to_csv(entries: list[LedgerEntryRead]) -> str:
    """The entries with a header row; amounts at full precision, so the rows sum to the JSON totals."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    for e in entries:
        writer.writerow([e.created_at.isoformat(), e.kind.value, e.worker_id or "", e.job_id,
                         "" if e.step is None else e.step, e.groups, repr(e.seconds), repr(e.amount_usd),
                         e.memo or ""])
    return out.getvalue()


def _page(db: Session, where: list[ColumnElement[bool]], limit: int,
          offset: int) -> tuple[list[LedgerEntryRead], int]:
    total = db.scalar(select(func.count()).select_from(LedgerEntry).where(*where)) or 0
    # The rollout ids a worker entry names can be hundreds: not part of a statement, so not loaded.
    rows = db.scalars(select(LedgerEntry).options(defer(LedgerEntry.rollout_ids)).where(*where)
                      .order_by(LedgerEntry.created_at, LedgerEntry.id).limit(limit).offset(offset))
    return [LedgerEntryRead.model_validate(r) for r in rows], total


def _totals(db: Session, key: Any, where: list[ColumnElement[bool]]) -> list[LedgerTotal]:
    rows = db.execute(select(key, func.count(), func.coalesce(func.sum(LedgerEntry.groups), 0),
                             func.coalesce(func.sum(LedgerEntry.seconds), 0.0),
                             func.coalesce(func.sum(LedgerEntry.amount_usd), 0.0))
                      .where(*where).group_by(key).order_by(key))
    return [LedgerTotal(key=k or "", entries=n, groups=int(groups), seconds=float(seconds), amount_usd=float(amount))
            for k, n, groups, seconds, amount in rows]


def next_offset(offset: int, got: int, total: int) -> int | None:
    """The offset of the page after one of `got` entries at `offset`; None on the last page."""
    return offset + got if offset + got < total else None
