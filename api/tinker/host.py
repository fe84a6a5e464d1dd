"""Routes of the Tinker learner host (learner/tinker/host.py), authenticated with an admin API key.

`claim` long-polls for the host's next request: the next one of a model it holds, or, while it has a
free slot, the next of a model it parked or a new model to load. The host says which models it holds: one
it was given but no longer holds (it restarted) is failed with the reason, and one whose session ended is
dropped. When the host is full and another model waits, its model idle longest (PARK_AFTER_S at least), or
else the one that has held its slot longest (SLICE_S at least), is parked: the host saves its state to disk
and frees the slot; its next request loads it again there. So one client's model, idle or busy, does not
keep everyone else's waiting while its session lasts.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta

import anyio
from echo2.protocol.tinker import (
    ErrorCategory,
    HostClaim,
    HostRequestState,
    HostResult,
    HostWork,
    HostWorkReply,
    ModelSpec,
    ModelStatus,
    RequestKind,
    RequestStatus,
    SamplePayload,
    SessionStatus,
    TinkerLora,
)
from fastapi import Query, Request
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from ..db import Database
from ..deps import SessionDep, SettingsDep
from ..models import utcnow
from ..routing import make_router
from ..settings import Settings
from . import checkpoints, fleet, queueing, service
from .deps import ApiKey, Bell, HostUser, require_host, user_of
from .models import TinkerHost, TinkerModel, TinkerRequest, TinkerSession
from .sampling import MAX_SAMPLE_TOKENS

router = make_router(prefix="/v1/tinker/host", tags=["tinker"], include_in_schema=False)
MAX_SAMPLE_BATCH = 32
PARK_AFTER_S = 60.0  # a model idle this long gives its slot up to one that waits
SLICE_S = 120.0  # and a busy one, once it has held the slot this long: two busy clients of one slot take turns


@router.get("/requests/{request_id}")
def request_state(request_id: str, user: HostUser, db: SessionDep) -> HostRequestState:
    """Asked by a host while it runs the request: once its session ended the host stops and frees its slot."""
    row = db.get(TinkerRequest, request_id)
    return HostRequestState(running=row is not None and row.status == RequestStatus.running)


@router.post("/claim")
async def claim(body: HostClaim, api_key: ApiKey, request: Request) -> HostWorkReply:
    state = request.app.state
    deadline = time.monotonic() + body.wait_s
    while True:
        reply, refused = await anyio.to_thread.run_sync(_claim_once, state.db, state.settings, api_key, body)
        for request_id in refused:  # its client waiting on the future hears at once
            state.announcer.announce(service.request_key(request_id))
        left = deadline - time.monotonic()
        if reply.work is not None or left <= 0:
            return reply
        await state.announcer.wait(service.HOSTS_KEY, min(left, 2.0))
        if await request.is_disconnected():  # the host is gone: work given to it now would wait for nobody
            return HostWorkReply()


def _claim_once(database: Database, settings: Settings, api_key: str,
                body: HostClaim) -> tuple[HostWorkReply, list[str]]:
    with database.session() as db:
        require_host(user_of(db, api_key))
        host = db.get(TinkerHost, body.host, with_for_update=True) or TinkerHost(name=body.host)
        host.slots, host.price_per_hour, host.seen_at = body.slots, body.price_per_hour, utcnow()
        db.add(host)
        service.sweep(db)
        checkpoints.expire(db, settings.data_dir / "tinker-states")
        held = _held(db, body)
        parked = _parked(db, body.host)
        # A model still in `holding` but parked: the reply that asked to park it was lost; ask again.
        drop = [m for m in body.holding if m not in held and m not in parked] + _ended(db, body.host)
        park = [m for m in body.holding if m in parked]
        if len(held) >= body.slots:  # full: a model that waits may take the slot of one held here
            made = _make_room(db, body.host, held)
            park, held = park + made, held - set(made)
        free = body.slots - len(held)
        row, refused = _pick(db, held, body.host, free)
        work = _start(db, row, settings) if row is not None else None
        more = [_start(db, r, settings) for r in _batchable(db, row)] if row is not None else []
        db.commit()
        return HostWorkReply(work=work, more=more, drop=drop, park=park), refused


def _pick(db: Session, held: set[str], host: str, free: int) -> tuple[TinkerRequest | None, list[str]]:
    """The request to run next, and the ids of those failed on the way: the waiting requests of a user whose daily
    quota was spent after they were queued fail, all at once (its jobs pause the same way). The platform's own
    requests (audits, dropping a checkpoint) run whatever the quota."""
    refused: list[str] = []
    while (row := _next_request(db, list(held)) or _admit(db, host, free)) is not None:
        why = None if row.kind in service.PLATFORMS else queueing.quota_spent(db, row.owner_id)
        if why is None:
            return row, refused
        refused += _refuse(db, row.owner_id, why)
    return None, refused


def _refuse(db: Session, owner_id: str, why: str) -> list[str]:
    """Fail the user's waiting requests (a create_model's model with it); their ids. Locked in id order: two hosts
    refusing one user at once take the rows in the same order."""
    rows = db.execute(select(TinkerRequest.id, TinkerRequest.kind, TinkerRequest.model_id).where(
        TinkerRequest.owner_id == owner_id, TinkerRequest.status == RequestStatus.pending,
        TinkerRequest.kind.not_in(service.PLATFORMS)).order_by(TinkerRequest.id).with_for_update()).all()
    ids = [r.id for r in rows]
    service.fail_requests(db, TinkerRequest.id.in_(ids), why, ErrorCategory.user)
    for model in db.scalars(select(TinkerModel).where(TinkerModel.id.in_(
            [r.model_id for r in rows if r.kind == RequestKind.create_model])).order_by(TinkerModel.id)):
        service.fail_model(db, model, why, ErrorCategory.user)
    db.flush()
    return ids


def _held(db: Session, body: HostClaim) -> set[str]:
    """The host's live models. One it had loaded and no longer holds fails (the host restarted, its state is
    gone); a request it was given and never reported goes out again (a serial host asking for work runs
    nothing, so the reply carrying it was lost)."""
    rows = db.scalars(select(TinkerModel).join(TinkerSession, TinkerSession.id == TinkerModel.session_id).where(
        TinkerModel.host == body.host,
        TinkerModel.status.not_in((ModelStatus.failed, ModelStatus.parked)),
        TinkerSession.status == SessionStatus.active))
    held = set()
    for model in rows:
        if model.status == ModelStatus.ready and model.id not in body.holding:
            service.fail_model(db, model, f"learner host {body.host} restarted and lost this model; create a new "
                                          "client", ErrorCategory.server)
            continue
        held.add(model.id)
    db.execute(update(TinkerRequest).where(TinkerRequest.model_id.in_(held),
                                           TinkerRequest.status == RequestStatus.running)
               .values(status=RequestStatus.pending, started_at=None))
    return held


def _next_request(db: Session, models: list[str]) -> TinkerRequest | None:
    """The first pending request (they run in seq order) of the host's model served longest ago: the models
    take turns, so a client that queues hundreds of requests delays another's by one request, not hundreds."""
    waiting = select(TinkerRequest.model_id).where(TinkerRequest.model_id.in_(models),
                                                   TinkerRequest.status == RequestStatus.pending)
    served = func.max(TinkerRequest.started_at)
    turn = db.execute(select(TinkerRequest.model_id, served).where(TinkerRequest.model_id.in_(waiting))
                      .group_by(TinkerRequest.model_id)
                      .order_by(served.is_not(None), served, func.min(TinkerRequest.created_at)).limit(1)
                      ).first()
    if turn is None:
        return None
    return db.scalar(select(TinkerRequest).where(TinkerRequest.model_id == turn[0],
                                                 TinkerRequest.status == RequestStatus.pending)
                     .order_by(TinkerRequest.seq).limit(1).with_for_update())


def _batchable(db: Session, first: TinkerRequest) -> list[TinkerRequest]:
    """The sample requests right behind a sample request in its model's queue, of the same checkpoint:
    nothing that changes the weights comes between, so they may run in one batch."""
    if first.kind != RequestKind.sample:
        return []
    after = db.scalars(select(TinkerRequest).where(TinkerRequest.model_id == first.model_id,
                                                   TinkerRequest.status == RequestStatus.pending,
                                                   TinkerRequest.seq > first.seq)
                       .order_by(TinkerRequest.seq).limit(MAX_SAMPLE_BATCH - 1).with_for_update())
    batch, size = [], _sample_size(first)
    for row in after:
        if row.kind != RequestKind.sample or _weights_of(row) != _weights_of(first):
            break
        size += _sample_size(row)
        if size > MAX_SAMPLE_TOKENS:  # the batch's KV cache is bounded as one request's is
            break
        batch.append(row)
    return batch


def _weights_of(row: TinkerRequest) -> str | None:
    """The weights a sample request draws with: its checkpoint's, or the model's newest in-flight ones."""
    return "<inflight>" if row.payload.get("inflight") else row.payload.get("checkpoint")


def _sample_size(row: TinkerRequest) -> int:
    payload = SamplePayload.model_validate(row.payload)
    return payload.num_samples * (len(payload.prompt) + payload.params.max_tokens)


def _parked(db: Session, host: str) -> set[str]:
    """The host's parked models of live sessions."""
    return set(db.scalars(select(TinkerModel.id).join(TinkerSession, TinkerSession.id == TinkerModel.session_id)
                          .where(TinkerModel.host == host, TinkerModel.status == ModelStatus.parked,
                                 TinkerSession.status == SessionStatus.active)))


def _ended(db: Session, host: str) -> list[str]:
    """Parked models whose session is over: the host deletes their state; they are failed so that it is
    told once."""
    rows = list(db.scalars(select(TinkerModel).join(TinkerSession, TinkerSession.id == TinkerModel.session_id)
                           .where(TinkerModel.host == host, TinkerModel.status == ModelStatus.parked,
                                  TinkerSession.status != SessionStatus.active)))
    for model in rows:
        model.status, model.error = ModelStatus.failed, "the session ended"
    return [m.id for m in rows]


def _waiters(db: Session, host: str) -> list[tuple[datetime, TinkerModel]]:
    """The models waiting for a slot on this host, each with the time it has waited since: its parked models
    with a request (since parked, or since the first request after that), and the models no host has loaded
    yet (since created)."""
    first = (select(TinkerRequest.model_id, func.min(TinkerRequest.created_at).label("since"))
             .where(TinkerRequest.status == RequestStatus.pending).group_by(TinkerRequest.model_id).subquery())
    parked = db.execute(select(TinkerModel, first.c.since).join(first, first.c.model_id == TinkerModel.id)
                        .where(TinkerModel.id.in_(_parked(db, host)))).all()
    new = db.scalars(select(TinkerModel).join(TinkerSession, TinkerSession.id == TinkerModel.session_id).where(
        TinkerModel.host.is_(None), TinkerModel.status == ModelStatus.pending,
        TinkerSession.status == SessionStatus.active).order_by(TinkerModel.created_at).limit(1))
    return ([(max(since, model.slot_at or since), model) for model, since in parked]
            + [(model.created_at, model) for model in new])


def _admit(db: Session, host: str, free: int) -> TinkerRequest | None:
    """With a free slot, the model that has waited longest takes it (a parked one is restored, see _start)
    and its next request runs."""
    waiters = _waiters(db, host) if free > 0 else []
    if not waiters:
        return None
    _, model = min(waiters, key=lambda pair: pair[0])
    if model.host is None:  # two hosts may pick the same new model at once: one gets it
        claimed = db.execute(update(TinkerModel).where(TinkerModel.id == model.id, TinkerModel.host.is_(None))
                             .values(host=host))
        if claimed.rowcount != 1:
            return None
    return _next_request(db, [model.id])


def _make_room(db: Session, host: str, held: set[str]) -> list[str]:
    """If a model waits for a slot on this full host (a parked one of its own with a request, or a new one),
    one held here is parked: the one idle longest, PARK_AFTER_S at least, or else the one that took its slot
    longest ago, SLICE_S at least. The host asks for work only once it has reported what it ran, so
    nothing it holds is running now."""
    if not _waiters(db, host):
        return []
    now = utcnow()
    ready = list(db.scalars(select(TinkerModel).where(TinkerModel.id.in_(held),
                                                      TinkerModel.status == ModelStatus.ready)))
    idle = [(last, model) for model in ready
            if (last := _idle_since(db, model)) is not None and last <= now - timedelta(seconds=PARK_AFTER_S)]
    long = [(loaded, model) for model in ready
            if (loaded := model.slot_at or model.created_at) <= now - timedelta(seconds=SLICE_S)]
    if not idle and not long:
        return []
    _, model = min(idle or long, key=lambda pair: pair[0])
    model.status, model.slot_at = ModelStatus.parked, now
    return [model.id]


def _idle_since(db: Session, model: TinkerModel) -> datetime | None:
    """When the model's last request finished (its creation if none), or None while one is pending or running."""
    busy = db.scalar(select(TinkerRequest.id).where(TinkerRequest.model_id == model.id,
                                                    TinkerRequest.status.in_((RequestStatus.pending,
                                                                              RequestStatus.running))).limit(1))
    if busy is not None:
        return None
    last = db.scalar(select(func.max(TinkerRequest.finished_at)).where(TinkerRequest.model_id == model.id))
    return last or model.created_at


def _start(db: Session, row: TinkerRequest, settings: Settings) -> HostWork:
    model = db.get(TinkerModel, row.model_id)
    assert model is not None
    row.status, row.started_at = RequestStatus.running, utcnow()
    restore = model.status == ModelStatus.parked
    if restore:
        model.status = ModelStatus.ready
    if restore or row.kind == RequestKind.create_model:
        model.slot_at = row.started_at
    lora = TinkerLora(**model.lora) if model.lora else None
    publish = fleet.publish_order(db, model, settings, bool(row.payload.get("inflight"))) \
        if row.kind == RequestKind.save_weights_for_sampler else None
    return HostWork(request_id=row.id, model_id=model.id, kind=RequestKind(row.kind),
                    model=ModelSpec(base_model=model.base_model, lora=lora), payload=row.payload, restore=restore,
                    publish=publish)


@router.post("/requests/{request_id}/result")
def report(request_id: str, body: HostResult, user: HostUser, db: SessionDep, bell: Bell, settings: SettingsDep,
           host: str = Query(max_length=128)) -> dict[str, bool]:
    """Store a request's outcome; one the control plane already failed (its session ended) is ignored."""
    row = db.get(TinkerRequest, request_id, with_for_update=True)
    model = db.get(TinkerModel, row.model_id) if row is not None else None
    if row is None or model is None or model.host != host or row.status != RequestStatus.running:
        return {"accepted": False}
    answered = service.record_result(db, row, body, host, settings)
    db.commit()
    for request in (row.id, *answered):
        bell.announce(service.request_key(request))
    return {"accepted": True}
