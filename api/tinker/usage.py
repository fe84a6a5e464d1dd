"""The Tinker ledger: every finished request billed at its host's price for the host's compute time.

A request is billed once, when its host reports it done: failed requests (the caller's input, a host that
died, a session that ended) cost nothing, as a rollout nobody could use costs its job nothing. Totals are
summed by the database over every entry of the user (or of one session), so they hold whatever the page.
"""

from __future__ import annotations

from typing import Any

from echo2.protocol.tinker import (
    ForwardBackwardPayload,
    HostResult,
    RequestKind,
    SamplePayload,
    TinkerUsage,
    TinkerUsageEntry,
    TinkerUsageTotal,
)
from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session

from ..services.ledger import next_offset
from .models import TinkerHost, TinkerModel, TinkerRequest
from .models import TinkerUsage as UsageRow


def bill(db: Session, request: TinkerRequest, model: TinkerModel, host: str, result: HostResult) -> None:
    """The ledger entry of a request its host ran; `request.payload` must still hold its input."""
    row = db.get(TinkerHost, host)
    price = row.price_per_hour if row is not None else 0.0
    seconds = result.seconds if result.seconds is not None else _wall_seconds(request)
    prompt = 0
    if request.kind == RequestKind.sample:
        payload = SamplePayload.model_validate(request.payload)
        seconds += payload.progress.seconds if payload.progress is not None else 0.0  # earlier in-flight segments
        prompt = len(payload.prompt) if result.sample is not None else 0
    db.add(UsageRow(owner_id=request.owner_id, session_id=model.session_id, model_id=model.id,
                    request_id=request.id, kind=request.kind, host=host, tokens=_tokens(request, result),
                    prompt_tokens=prompt, seconds=seconds, price_per_hour=price, amount_usd=price * seconds / 3600))


def _wall_seconds(request: TinkerRequest) -> float:
    if request.started_at is None or request.finished_at is None:
        return 0.0
    return max((request.finished_at - request.started_at).total_seconds(), 0.0)


def _tokens(request: TinkerRequest, result: HostResult) -> int:
    if request.kind in (RequestKind.forward, RequestKind.forward_backward):
        return sum(len(d.tokens) for d in ForwardBackwardPayload.model_validate(request.payload).data)
    if request.kind == RequestKind.sample and result.sample is not None:
        prompt = len(SamplePayload.model_validate(request.payload).prompt)
        return prompt + sum(len(s.tokens) for s in result.sample.sequences)
    return 0


def usage(db: Session, owner_id: str, session_id: str | None, limit: int, offset: int) -> TinkerUsage:
    where = [UsageRow.owner_id == owner_id]
    if session_id is not None:
        where.append(UsageRow.session_id == session_id)
    total = db.scalar(select(func.count()).select_from(UsageRow).where(*where)) or 0
    rows = db.scalars(select(UsageRow).where(*where).order_by(UsageRow.created_at, UsageRow.id)
                      .limit(limit).offset(offset))
    entries = [TinkerUsageEntry.model_validate(r) for r in rows]
    by_kind = _totals(db, UsageRow.kind, where)
    return TinkerUsage(entries=entries, total_entries=total, next_offset=next_offset(offset, len(entries), total),
                       by_session=_totals(db, UsageRow.session_id, where),
                       by_model=_totals(db, UsageRow.model_id, where), by_kind=by_kind,
                       total_usd=sum(t.amount_usd for t in by_kind))


def _totals(db: Session, key: Any, where: list[ColumnElement[bool]]) -> list[TinkerUsageTotal]:
    rows = db.execute(select(key, func.count(), func.coalesce(func.sum(UsageRow.tokens), 0),
                             func.coalesce(func.sum(UsageRow.seconds), 0.0),
                             func.coalesce(func.sum(UsageRow.amount_usd), 0.0))
                      .where(*where).group_by(key).order_by(key))
    return [TinkerUsageTotal(key=k, entries=n, tokens=int(tokens), seconds=float(seconds), amount_usd=float(amount))
            for k, n, tokens, seconds, amount in rows]
