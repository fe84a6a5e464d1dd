"""The life cycle of Tinker checkpoints (RestClient): list a model's or all of a user's, set a TTL, delete, copy.

Retention (what `GET /api/v1/checkpoints` shows as `expires_at`, and docs/TINKER.md states):
- a state saved with save_state lives in the control plane's store (api/tinker/states.py) until it is deleted
  or its `ttl_seconds` pass; no TTL: kept until deleted;
- a sampler checkpoint lives in the memory of the host holding its model, so at most as long as its model
  (its session: `service.finish_session` deletes its row); a TTL ends it sooner. Its fleet versions are
  collected by the fleet job's retention (the last two versions and the base are kept).
Deleting, or expiring, removes the row at once (the API no longer lists or loads it) and the state's file
once no copy names it; a sampler checkpoint's weights are dropped from its host's memory by a request queued
on its live model (`drop_checkpoint`), which the host runs in order with the model's other requests.

A copy (`copy_weights`) is a new training run (a model that cannot be trained on, `kind="copy"`) holding one
checkpoint that names the same stored file: no bytes are duplicated, and its TTL is its own. Only states can
be copied: a sampler checkpoint's weights are in its host's memory, not in the store.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

from echo2.protocol.tinker import (
    TEN_YEARS_S,
    CheckpointKind,
    ModelKind,
    ModelStatus,
    RequestKind,
)
from fastapi import Query, Request
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..deps import SessionDep
from ..errors import ApiError
from ..models import utcnow
from ..routing import make_router
from . import queueing, service, states
from .deps import Bell, IdempotencyKey, TinkerUser
from .models import TinkerCheckpoint, TinkerModel, TinkerRequest, TinkerSession
from .schemas import CopyWeightsRequest, TtlRequest, WeightsInfoRequest

router = make_router(prefix="/api/v1", tags=["tinker"], include_in_schema=False)
SEGMENTS = {kind.segment: kind for kind in CheckpointKind}


def as_sdk(row: TinkerCheckpoint) -> dict[str, Any]:
    """tinker.types.Checkpoint."""
    return {"checkpoint_id": f"{row.kind.segment}/{row.name}", "checkpoint_type": row.kind.value,
            "tinker_path": service.checkpoint_path(row.model_id, row.kind, row.name),
            "time": row.created_at.isoformat(), "size_bytes": row.size_bytes, "public": False, "user_metadata": None,
            "expires_at": row.expires_at.isoformat() if row.expires_at else None}


def _live(owner_id: str):  # type: ignore[no-untyped-def]
    now = utcnow()
    return (select(TinkerCheckpoint).join(TinkerModel, TinkerModel.id == TinkerCheckpoint.model_id)
            .where(TinkerModel.owner_id == owner_id,
                   TinkerCheckpoint.expires_at.is_(None) | (TinkerCheckpoint.expires_at > now)))


@router.get("/training_runs/{model_id}/checkpoints")
def list_checkpoints(model_id: str, user: TinkerUser, db: SessionDep) -> dict[str, Any]:
    _owned_run(db, user.id, model_id)
    rows = db.scalars(_live(user.id).where(TinkerCheckpoint.model_id == model_id)
                      .order_by(TinkerCheckpoint.created_at.desc()))
    return {"checkpoints": [as_sdk(r) for r in rows], "cursor": None}


@router.get("/checkpoints")
def list_user_checkpoints(user: TinkerUser, db: SessionDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                          offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0) -> dict[str, Any]:
    total = db.scalar(select(func.count()).select_from(_live(user.id).subquery())) or 0
    rows = db.scalars(_live(user.id).order_by(TinkerCheckpoint.created_at.desc()).limit(limit).offset(offset))
    return {"checkpoints": [as_sdk(r) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.put("/training_runs/{model_id}/checkpoints/{segment}/{name}/ttl")
def set_ttl(model_id: str, segment: str, name: str, body: TtlRequest, user: TinkerUser, db: SessionDep) -> None:
    row = _owned_checkpoint(db, user.id, model_id, segment, name)
    if body.ttl_seconds is not None and not 3600 <= body.ttl_seconds <= TEN_YEARS_S:
        raise ApiError(400, f"ttl_seconds must be between 3600 (an hour) and {TEN_YEARS_S} (ten years), or null to "
                            "keep the checkpoint until it is deleted", field="ttl_seconds")
    row.expires_at = utcnow() + timedelta(seconds=body.ttl_seconds) if body.ttl_seconds else None
    db.commit()


@router.delete("/training_runs/{model_id}/checkpoints/{segment}/{name}")
def delete_checkpoint(model_id: str, segment: str, name: str, user: TinkerUser, db: SessionDep, request: Request,
                      bell: Bell) -> None:
    row = _owned_checkpoint(db, user.id, model_id, segment, name)
    remove(db, [row], _root(request))
    db.commit()
    bell.announce(service.HOSTS_KEY)


@router.post("/copy_weights")
def copy_weights(body: CopyWeightsRequest, user: TinkerUser, db: SessionDep, key: IdempotencyKey) -> dict[str, Any]:
    """A state's copy under a new training run; `destination_project_id` is accepted and unused (Echo2 has no
    projects: every run belongs to its user)."""
    source = service.saved_state(db, user.id, body.source_path) if "/weights/" in body.source_path else None
    if source is None:
        raise ApiError(400, "Echo2 copies states (tinker://RUN/weights/NAME, saved with save_state): a sampler "
                            "checkpoint's weights live in its host's memory, not in the store", field="source_path")
    if body.ttl_seconds is not None and not 3600 <= body.ttl_seconds <= TEN_YEARS_S:
        raise ApiError(400, f"ttl_seconds must be between 3600 and {TEN_YEARS_S}, or null", field="ttl_seconds")
    run = _copy_run(db, user.id, body, source, key)
    existing = db.get(TinkerCheckpoint, (run.id, source.name, CheckpointKind.training))
    if existing is not None and existing.sha256 != source.sha256:  # answering its path gave another state's copy
        raise ApiError(400, f"training run {run.id} holds a copy of another state named {source.name!r} already: "
                            "give a model_seq_id that is new in the session", field="model_seq_id")
    if existing is None:
        db.add(TinkerCheckpoint(model_id=run.id, name=source.name, kind=CheckpointKind.training, step=source.step,
                                host=source.host, sha256=source.sha256, size_bytes=source.size_bytes,
                                expires_at=utcnow() + timedelta(seconds=body.ttl_seconds) if body.ttl_seconds
                                else None))
    db.commit()
    return {"tinker_path": service.checkpoint_path(run.id, CheckpointKind.training, source.name)}


def _copy_run(db: Session, owner_id: str, body: CopyWeightsRequest, source: TinkerCheckpoint,
              key: str | None) -> TinkerModel:
    origin = db.get(TinkerModel, source.model_id)
    assert origin is not None
    if body.session_id is not None:
        session = service.owned_session(db, owner_id, body.session_id)
        seq = body.model_seq_id if body.model_seq_id is not None else _idempotent_suffix(owner_id, key)
        run_id = f"{session.id}:copy:{seq}"
    else:
        session = db.get(TinkerSession, origin.session_id)
        assert session is not None
        run_id = f"copy_{_idempotent_suffix(owner_id, key)}"
    run = db.get(TinkerModel, run_id)
    if run is None:
        run = TinkerModel(id=run_id, session_id=session.id, owner_id=owner_id, kind=ModelKind.copy,
                          base_model=origin.base_model, lora=origin.lora, status=ModelStatus.ready,
                          info=origin.info)
        db.add(run)
        db.flush()
    elif run.owner_id != owner_id or run.kind is not ModelKind.copy:
        raise ApiError(400, f"training run {run_id} exists already: model_seq_id must be new", field="model_seq_id")
    return run


def _idempotent_suffix(owner_id: str, key: str | None) -> str:
    """A retried copy (the same X-Idempotency-Key from the same user) lands on the same run; every other copy on a
    run of its own (the key alone named it: two users sending one key collided)."""
    if not key:
        return secrets.token_hex(12)
    return hashlib.sha256(f"{owner_id}\0{key}".encode()).hexdigest()[:24]


def remove(db: Session, rows: list[TinkerCheckpoint], root: Path) -> None:
    """Delete checkpoints: the rows now, the states' files once no copy names them, a sampler checkpoint's
    weights from its host by a request queued on its live model."""
    digests = {r.sha256 for r in rows}
    for row in rows:
        model = db.get(TinkerModel, row.model_id)
        if row.kind is CheckpointKind.sampler and model is not None and model.status is not ModelStatus.failed \
                and not service.session_ended(db, model):
            queueing.enqueue(db, model, RequestKind.drop_checkpoint, {"name": row.name}, None, bounded=False)
        db.delete(row)
    db.flush()
    states.collect(db, root, digests)


def expire(db: Session, root: Path, now: datetime | None = None) -> int:
    """Remove the checkpoints whose TTL has passed (run by host claims); returns how many."""
    rows = list(db.scalars(select(TinkerCheckpoint).where(TinkerCheckpoint.expires_at <= (now or utcnow()))
                           .limit(256)))
    if rows:
        remove(db, rows, root)
    return len(rows)


def _root(request: Request) -> Path:
    return states.root(request)


def _owned_run(db: Session, owner_id: str, model_id: str) -> TinkerModel:
    run = db.get(TinkerModel, model_id)
    if run is None or run.owner_id != owner_id:
        raise ApiError(404, f"training run {model_id} not found", field="training_run_id")
    return run


def _owned_checkpoint(db: Session, owner_id: str, model_id: str, segment: str, name: str) -> TinkerCheckpoint:
    kind = SEGMENTS.get(segment)
    if kind is None:
        raise ApiError(400, f"checkpoint ids are weights/NAME or sampler_weights/NAME, not {segment}/{name}",
                       field="checkpoint_id")
    _owned_run(db, owner_id, model_id)
    row = db.get(TinkerCheckpoint, (model_id, name, kind))
    if row is None or service.expired(row):
        raise ApiError(404, f"checkpoint tinker://{model_id}/{segment}/{name} not found", field="checkpoint_id")
    return row


def _run(db: Session, run: TinkerModel) -> dict[str, Any]:
    """tinker.types.TrainingRun."""
    rows = list(db.scalars(_live(run.owner_id).where(TinkerCheckpoint.model_id == run.id)
                           .order_by(TinkerCheckpoint.created_at.desc())))
    last = db.scalar(select(func.max(TinkerRequest.created_at)).where(TinkerRequest.model_id == run.id))
    lora = run.lora or {}
    newest = {kind: next((as_sdk(r) for r in rows if r.kind is kind), None) for kind in CheckpointKind}
    return {"training_run_id": run.id, "base_model": run.base_model, "model_owner": run.owner_id,
            "is_lora": run.lora is not None, "corrupted": run.status is ModelStatus.failed,
            "lora_rank": lora.get("rank"), "last_request_time": (last or run.created_at).isoformat(),
            "last_checkpoint": newest[CheckpointKind.training],
            "last_sampler_checkpoint": newest[CheckpointKind.sampler], "user_metadata": None}


@router.get("/training_runs/{model_id}")
def get_training_run(model_id: str, user: TinkerUser, db: SessionDep) -> dict[str, Any]:
    return _run(db, _owned_run(db, user.id, model_id))


@router.get("/training_runs")
def list_training_runs(user: TinkerUser, db: SessionDep, limit: Annotated[int, Query(ge=1, le=1000)] = 20,
                       offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0) -> dict[str, Any]:
    where = (TinkerModel.owner_id == user.id, TinkerModel.kind.in_((ModelKind.train, ModelKind.copy)))
    total = db.scalar(select(func.count()).select_from(TinkerModel).where(*where)) or 0
    runs = db.scalars(select(TinkerModel).where(*where).order_by(TinkerModel.created_at.desc()).limit(limit)
                      .offset(offset))
    return {"training_runs": [_run(db, r) for r in runs],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.post("/weights_info")
def weights_info(body: WeightsInfoRequest, user: TinkerUser, db: SessionDep) -> dict[str, Any]:
    parts = body.tinker_path.removeprefix("tinker://").split("/")
    if not body.tinker_path.startswith("tinker://") or len(parts) != 3 or parts[1] not in SEGMENTS:
        raise ApiError(400, f"{body.tinker_path!r} is not tinker://RUN/weights/NAME or .../sampler_weights/NAME",
                       field="tinker_path")
    _owned_checkpoint(db, user.id, parts[0], parts[1], parts[2])
    run = _owned_run(db, user.id, parts[0])
    lora = run.lora or {}
    return {"base_model": run.base_model, "is_lora": run.lora is not None, "lora_rank": lora.get("rank"),
            "train_unembed": lora.get("train_unembed"), "train_mlp": lora.get("train_mlp"),
            "train_attn": lora.get("train_attn")}
