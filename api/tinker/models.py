"""Tables of the Tinker-compatible surface: sessions, the models trained or sampled in them, their
checkpoints, the requests (the SDK's futures, durable: a result is kept ECHO2_ARCHIVE_AFTER_H after its
session ends) and the learner hosts that run them."""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any

from echo2.protocol.tinker import (
    CheckpointKind,
    ErrorCategory,
    ModelKind,
    ModelStatus,
    RequestKind,
    RequestStatus,
    SessionStatus,
)
from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from ..models import Base, stored_as_value, utcnow


def new_tinker_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class TinkerSession(Base):
    __tablename__ = "tinker_sessions"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_tinker_id("tks"))
    owner_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    sdk_version: Mapped[str] = mapped_column(String(32))
    tags: Mapped[list[Any]] = mapped_column(default=list)
    status: Mapped[SessionStatus] = mapped_column(stored_as_value(SessionStatus), default=SessionStatus.active)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]


class TinkerModel(Base):
    """A training client's model (`{session}:train:{n}`), or a sampler's (`{session}:sample:{n}`): what a
    learner host loads and keeps while the session lasts."""

    __tablename__ = "tinker_models"
    id: Mapped[str] = mapped_column(String(96), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("tinker_sessions.id", ondelete="CASCADE"), index=True)
    owner_id: Mapped[str] = mapped_column(String(32), index=True)
    kind: Mapped[ModelKind] = mapped_column(stored_as_value(ModelKind))
    base_model: Mapped[str] = mapped_column(String(512))
    lora: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    host: Mapped[str | None] = mapped_column(String(128), index=True)
    status: Mapped[ModelStatus] = mapped_column(stored_as_value(ModelStatus), default=ModelStatus.pending)
    error: Mapped[str | None] = mapped_column(String(1024))
    info: Mapped[dict[str, Any]] = mapped_column(default=dict)  # what the host reports: tokenizer, vocab
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    slot_at: Mapped[datetime | None]  # when it last took its host slot (loaded or restored) or gave it up (parked)


class TinkerCheckpoint(Base):
    """Weights saved under a name (`tinker://{model}/sampler_weights/{name}`); the host holding the
    model keeps the bytes, in memory while the model lives, and a state saved with save_state
    (`tinker://{model}/weights/{name}`) on its disk too, to load again later."""

    __tablename__ = "tinker_checkpoints"
    model_id: Mapped[str] = mapped_column(ForeignKey("tinker_models.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    # A name is its kind's: `weights/N` and `sampler_weights/N` are two checkpoints (tinker-cookbook saves both).
    kind: Mapped[CheckpointKind] = mapped_column(stored_as_value(CheckpointKind), primary_key=True)
    step: Mapped[int] = mapped_column(Integer)
    host: Mapped[str | None] = mapped_column(String(128))  # a "training" state: the host that saved it
    version: Mapped[int | None] = mapped_column(Integer)  # a sampler's: its version in the model's fleet job
    sha256: Mapped[str | None] = mapped_column(String(64), index=True)  # a state's file in the control plane's store
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    inflight: Mapped[bool] = mapped_column(default=False)  # a sampler's: saved with kind="inflight"
    expires_at: Mapped[datetime | None] = mapped_column(index=True)  # ttl_seconds; None: kept until deleted
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class TinkerSampler(Base):
    """A sampling session: the model whose host samples, and the checkpoint it samples from (None: the
    model's weights as they are, for a base-model sampler)."""

    __tablename__ = "tinker_samplers"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("tinker_sessions.id", ondelete="CASCADE"), index=True)
    owner_id: Mapped[str] = mapped_column(String(32), index=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("tinker_models.id", ondelete="CASCADE"))
    checkpoint: Mapped[str | None] = mapped_column(String(128))
    base_model: Mapped[str] = mapped_column(String(512))
    model_path: Mapped[str | None] = mapped_column(String(512))
    inflight: Mapped[bool] = mapped_column(default=False)  # samples with the model's newest in-flight checkpoint
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class TinkerSequence(Base):
    """A sequence sampled with record_stability_info (`{request}:{k}`, the SDK's `SampledSequence.sequence_id`):
    what stable_reinforce trains on, looked up through a datum's provenance spans. Kept RECORD_TTL_S after it
    was drawn or last trained on."""

    __tablename__ = "tinker_sequences"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner_id: Mapped[str] = mapped_column(String(32), index=True)
    model_id: Mapped[str] = mapped_column(String(96))
    prompt: Mapped[list[Any]]
    tokens: Mapped[list[Any]]
    logprobs: Mapped[list[Any]]
    checkpoints: Mapped[list[Any]]  # [name, count] runs: the checkpoint that drew each token
    worker_id: Mapped[str | None] = mapped_column(String(40))  # a fleet worker's draw; None: the learner host's
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(index=True)


class TinkerRequest(Base):
    """One future: a model's request, run by its host in `seq` order, with its result or its error."""

    __tablename__ = "tinker_requests"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_tinker_id("tkr"))
    owner_id: Mapped[str] = mapped_column(String(32), index=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("tinker_models.id", ondelete="CASCADE"))
    kind: Mapped[RequestKind] = mapped_column(stored_as_value(RequestKind, 32))
    seq: Mapped[int] = mapped_column(Integer)
    status: Mapped[RequestStatus] = mapped_column(stored_as_value(RequestStatus), default=RequestStatus.pending)
    payload: Mapped[dict[str, Any]]
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    error: Mapped[str | None] = mapped_column(String(1024))
    category: Mapped[ErrorCategory | None] = mapped_column(stored_as_value(ErrorCategory))
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    __table_args__ = (
        UniqueConstraint("owner_id", "idempotency_key"),
        UniqueConstraint("model_id", "seq"),
        Index("ix_tinker_requests_queue", "model_id", "status", "seq"),
    )


class TinkerHost(Base):
    """A learner host serving Tinker models; it claims requests, and its silence fails what it holds."""

    __tablename__ = "tinker_hosts"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    slots: Mapped[int] = mapped_column(Integer)
    price_per_hour: Mapped[float] = mapped_column(Float, default=0.0)  # the host's word: it runs with an admin key
    seen_at: Mapped[datetime] = mapped_column(default=utcnow)


class TinkerUsage(Base):
    """The Tinker ledger: one entry per finished request, its host's compute time at the host's price. Kept
    when the session, model or request is gone (plain ids, no foreign keys): it is what the user paid."""

    __tablename__ = "tinker_usage"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    owner_id: Mapped[str] = mapped_column(String(32), index=True)
    session_id: Mapped[str] = mapped_column(String(40), index=True)
    model_id: Mapped[str] = mapped_column(String(96))
    request_id: Mapped[str] = mapped_column(String(40), unique=True)
    kind: Mapped[RequestKind] = mapped_column(stored_as_value(RequestKind, 32))
    host: Mapped[str] = mapped_column(String(128))
    tokens: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)  # of `tokens`, a sample's prompt (its prefill)
    seconds: Mapped[float] = mapped_column(Float)
    price_per_hour: Mapped[float] = mapped_column(Float)
    amount_usd: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
