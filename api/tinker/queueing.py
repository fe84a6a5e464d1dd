"""A Tinker model's request queue: a request gets the model's next `seq` (the order its host runs them in), a
retried POST gets its first attempt's future, and one user's unfinished requests are bounded. Apart from
service.py so that the fleet, which queues the host's audits, and the service need not import each other."""

from __future__ import annotations

from echo2.protocol.tinker import RequestKind, RequestStatus
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..db import WRITER_LOCK
from ..errors import ApiError
from ..models import User, utcnow
from ..services.ledger import spent_today
from .models import TinkerModel, TinkerRequest

UNFINISHED = (RequestStatus.pending, RequestStatus.running, RequestStatus.fleet)
MAX_UNFINISHED = 512  # requests one user may have queued or running at once


def enqueue(db: Session, model: TinkerModel, kind: RequestKind, payload: dict,
            idempotency_key: str | None, bounded: bool = True) -> TinkerRequest:
    """The request's future; a retried POST (same Idempotency-Key) gets the future of its first attempt.
    `bounded=False`: the platform's own request (an audit), which the user's backlog does not limit."""
    # Lock the model row: two requests of one model never take the same seq, and a retry that arrives while
    # its first attempt is still in flight waits for it here, then finds it.
    db.execute(select(TinkerModel.id).where(TinkerModel.id == model.id).with_for_update(**WRITER_LOCK))
    earlier = earlier_attempt(db, model, kind, idempotency_key) or _created(db, model, kind, payload)
    if earlier is not None:
        return earlier
    if bounded:
        _check_backlog(db, model.owner_id)
        _check_quota(db, model.owner_id)
    last = db.scalar(select(func.max(TinkerRequest.seq)).where(TinkerRequest.model_id == model.id))
    row = TinkerRequest(owner_id=model.owner_id, model_id=model.id, kind=kind, seq=(last or 0) + 1,
                        payload=payload, idempotency_key=idempotency_key or None)
    try:
        with db.begin_nested():  # the same key sent for another model at once: its first use wins
            db.add(row)
    except IntegrityError:
        earlier = earlier_attempt(db, model, kind, idempotency_key)
        if earlier is None:
            raise
        return earlier
    return row


def earlier_attempt(db: Session, model: TinkerModel, kind: RequestKind,
                    idempotency_key: str | None) -> TinkerRequest | None:
    """The first attempt of a retried POST. A key this user sent with another call (another model, or kind) is
    refused: answered with that call's future, a create_model left its new model with no request, a model a host
    admitted and then held for good (nothing parks a model that was never created), one slot taken from everyone."""
    if not idempotency_key:
        return None
    row = db.scalar(select(TinkerRequest).where(TinkerRequest.owner_id == model.owner_id,
                                                TinkerRequest.idempotency_key == idempotency_key)
                    .execution_options(populate_existing=True))
    if row is not None and (row.model_id, row.kind) != (model.id, kind):
        raise ApiError(400, f"X-Idempotency-Key {idempotency_key!r} was sent with another call of yours (a "
                            f"{row.kind} of model {row.model_id}): give each call a key of its own, and repeat a "
                            "key only to retry its call", field="X-Idempotency-Key")
    return row


def _created(db: Session, model: TinkerModel, kind: RequestKind, payload: dict) -> TinkerRequest | None:
    """A model is created once: a repeat of its create_model (the same payload) gets the first one's future, where a
    second create rebuilt the live model from scratch, its adapter and optimizer lost; another payload is a 400."""
    if kind != RequestKind.create_model:
        return None
    first = db.scalar(select(TinkerRequest).where(TinkerRequest.model_id == model.id,
                                                  TinkerRequest.kind == RequestKind.create_model).limit(1))
    if first is not None and first.payload != payload:
        raise seq_taken(model.id)
    return first


def seq_taken(model_id: str) -> ApiError:
    return ApiError(400, f"model {model_id} exists already: model_seq_id must be new in its session",
                    field="model_seq_id")


def _check_quota(db: Session, owner_id: str) -> None:
    """A user past its daily quota ($ in any 24 hours, jobs and Tinker together) runs no more Tinker requests
    until the day's spending rolls off, as its jobs pause (scheduler/queue.py)."""
    if why := quota_spent(db, owner_id):
        raise ApiError(402, why)


def quota_spent(db: Session, owner_id: str) -> str | None:
    """Why the user may run no more Tinker requests now; None while its daily quota is not spent. Checked when a
    request is queued and again when a host would run it: requests queued before the quota was spent (512 may
    wait) ran and were billed past it."""
    limit = db.scalar(select(User.max_usd_per_day).where(User.id == owner_id))
    if limit is None or (spent := spent_today(db, owner_id, utcnow())) < limit:
        return None
    return (f"your daily quota of ${limit:.2f} is spent (${spent:.2f} in the last 24 h, jobs and Tinker together): "
            "requests are taken again as the day's spending rolls off, or an admin raises the quota")


def _check_backlog(db: Session, owner_id: str) -> None:
    """One user's queue is bounded: past MAX_UNFINISHED requests not yet run, a 429 the SDK retries after a
    pause (so a runaway loop slows down instead of filling the database and the hosts' queues)."""
    waiting = db.scalar(select(func.count()).select_from(TinkerRequest).where(
        TinkerRequest.owner_id == owner_id, TinkerRequest.status.in_(UNFINISHED))) or 0
    if waiting >= MAX_UNFINISHED:
        raise ApiError(429, f"{waiting} of your Tinker requests are not finished yet (at most {MAX_UNFINISHED}): "
                            "wait for their futures before sending more", headers={"Retry-After": "5"})
