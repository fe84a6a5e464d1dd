"""The Tinker SDK's session plumbing: client flags, sessions and their heartbeats, capabilities, telemetry."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from echo2.protocol.tinker import ModelKind, SessionStatus
from fastapi import Query
from sqlalchemy import select

from ..deps import SessionDep
from ..errors import ApiError
from ..models import utcnow
from ..routing import make_router
from . import service
from .deps import TinkerUser
from .models import TinkerModel, TinkerSampler, TinkerSession
from .schemas import ClientConfigRequest, CreateSessionRequest, FinishSession, SessionRef

router = make_router(prefix="/api/v1", tags=["tinker"], include_in_schema=False)

# The SDK's feature flags (tinker.types.ClientConfigResponse), set to the paths this server implements:
# API keys without a JWT exchange, one retrieve_future per request, losses computed on the server.
CLIENT_CONFIG: dict[str, Any] = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": True,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,
}


@router.post("/client/config")
def client_config(body: ClientConfigRequest, user: TinkerUser) -> dict[str, Any]:
    return CLIENT_CONFIG


@router.post("/client/dynamic_config")
def client_dynamic_config(body: ClientConfigRequest, user: TinkerUser) -> dict[str, Any]:
    return {"sample_cancel_enabled": False}


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
def capabilities(user: TinkerUser) -> dict[str, Any]:
    models = [{"model_name": name, "trainable": True, "sampleable": True} for name in service.BUILTINS]
    return {"supported_models": models}


@router.post("/create_session")
def create_session(body: CreateSessionRequest, user: TinkerUser, db: SessionDep) -> dict[str, Any]:
    session = TinkerSession(owner_id=user.id, sdk_version=body.sdk_version, tags=body.tags)
    db.add(session)
    db.commit()
    return {"type": "create_session", "session_id": session.id,
            "info_message": "Echo2: LoRA training on a learner host; see docs/TINKER.md for what differs"}


@router.post("/session_heartbeat")
def heartbeat(body: SessionRef, user: TinkerUser, db: SessionDep) -> dict[str, str]:
    session = db.get(TinkerSession, body.session_id)
    if session is None or session.owner_id != user.id:
        raise ApiError(404, f"session {body.session_id} not found", field="session_id")
    if session.status == SessionStatus.finished:  # the SDK stops heartbeating on a 410
        raise ApiError(410, f"session {session.id} is finished ({session.finish_reason})")
    session.heartbeat_at = utcnow()
    db.commit()
    return {"type": "session_heartbeat"}


# The SDK's access_scope: "accessible" adds what others shared with the caller; no session is shared here.
Scope = Annotated[Literal["owned", "accessible"], Query()]


@router.get("/sessions")
def list_sessions(user: TinkerUser, db: SessionDep, limit: Annotated[int, Query(ge=1, le=1000)] = 20,
                  offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
                  access_scope: Scope = "owned") -> dict[str, Any]:
    """tinker.types.ListSessionsResponse: the caller's sessions, newest first, finished ones included."""
    ids = db.scalars(select(TinkerSession.id).where(TinkerSession.owner_id == user.id)
                     .order_by(TinkerSession.created_at.desc(), TinkerSession.id).limit(limit).offset(offset))
    return {"sessions": list(ids)}


@router.get("/sessions/{session_id}")
def get_session(session_id: str, user: TinkerUser, db: SessionDep, access_scope: Scope = "owned") -> dict[str, Any]:
    """tinker.types.GetSessionResponse: the training runs (models trained or copied in it) and samplers it made."""
    session = db.get(TinkerSession, session_id)
    if session is None or session.owner_id != user.id:
        raise ApiError(404, f"session {session_id} not found")
    runs = db.scalars(select(TinkerModel.id).where(TinkerModel.session_id == session_id,
                                                   TinkerModel.kind.in_((ModelKind.train, ModelKind.copy)))
                      .order_by(TinkerModel.created_at, TinkerModel.id))
    samplers = db.scalars(select(TinkerSampler.id).where(TinkerSampler.session_id == session_id)
                          .order_by(TinkerSampler.created_at, TinkerSampler.id))
    return {"training_run_ids": list(runs), "sampler_ids": list(samplers), "user_metadata": None}


@router.post("/sessions/{session_id}/finish")
def finish(session_id: str, body: FinishSession, user: TinkerUser, db: SessionDep) -> dict[str, str]:
    session = db.get(TinkerSession, session_id, with_for_update=True)
    if session is None or session.owner_id != user.id:
        raise ApiError(404, f"session {session_id} not found")
    service.finish_session(db, session, body.reason.get("type", "success")[:16])
    db.commit()
    return {}


@router.post("/telemetry")
def telemetry(user: TinkerUser) -> dict[str, str]:
    """The SDK's own analytics events: accepted and not kept (the control plane has its own metrics)."""
    return {"status": "accepted"}
