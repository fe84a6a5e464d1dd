"""SQLAlchemy 2.0 typed ORM: the control plane's single source of truth."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from echo2.protocol import (
    AuditVerdict,
    DesiredState,
    JobKind,
    JobStatus,
    LeaseStatus,
    LedgerKind,
    PauseCause,
    Precision,
    PromptState,
    RejectKind,
    Role,
    RolloutStatus,
    TokenKind,
    TrustState,
    WorkerStatus,
)
from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from planner.decision import Action


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC in and out, also on SQLite (which drops the offset)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


def stored_as_value(enum: type[StrEnum], length: int = 16) -> Enum:
    """A column of one of the protocol's enums, read back as its members: stored as the member's value in a
    plain VARCHAR (no native type, no CHECK constraint), so the schema and the data are what they were."""
    return Enum(enum, native_enum=False, length=length, values_callable=lambda e: [m.value for m in e])


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON, list[Any]: JSON}


class User(Base):
    __tablename__ = "users"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("usr"))
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[Role] = mapped_column(stored_as_value(Role))
    # Quotas an admin sets (None: no limit). Jobs beyond them wait in the queue, they do not fail.
    max_concurrent_jobs: Mapped[int | None] = mapped_column(Integer)
    max_usd_per_day: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Token(Base):
    """A hashed bearer credential of any kind; the plaintext is shown once and never stored."""

    __tablename__ = "tokens"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("tok"))
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    kind: Mapped[TokenKind] = mapped_column(stored_as_value(TokenKind))
    principal_id: Mapped[str] = mapped_column(String(32), index=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


class Provider(Base):
    __tablename__ = "providers"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("prv"))
    name: Mapped[str] = mapped_column(String(128))
    contact: Mapped[str | None] = mapped_column(String(256))
    earnings_usd: Mapped[float] = mapped_column(Float, default=0.0)
    # Providers answer for their workers (api/services/trust.py): a quarantine puts the provider on watch
    # until it ends, a ban bans it.
    watch_until: Mapped[datetime | None]
    banned_at: Mapped[datetime | None]
    standing_reason: Mapped[str | None] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Worker(Base):
    __tablename__ = "workers"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("wrk"))
    provider_id: Mapped[str] = mapped_column(ForeignKey("providers.id"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    gpu_model: Mapped[str] = mapped_column(String(64))
    gpu_count: Mapped[int] = mapped_column(Integer)
    vram_gb: Mapped[float] = mapped_column(Float)
    price_per_hour: Mapped[float] = mapped_column(Float)
    region: Mapped[str] = mapped_column(String(64))
    upload_mbps: Mapped[float] = mapped_column(Float)
    download_mbps: Mapped[float] = mapped_column(Float)
    max_upload_mbps: Mapped[float | None] = mapped_column(Float)
    relay_url: Mapped[str | None] = mapped_column(String(512))
    backends: Mapped[list[Any]]
    rollouts_per_s: Mapped[float] = mapped_column(Float, default=0.0)
    tokens_per_s: Mapped[float] = mapped_column(Float, default=0.0)
    software: Mapped[str] = mapped_column(String(64))
    status: Mapped[WorkerStatus] = mapped_column(stored_as_value(WorkerStatus), default=WorkerStatus.idle, index=True)
    desired: Mapped[DesiredState] = mapped_column(stored_as_value(DesiredState), default=DesiredState.idle)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"), index=True)
    version_held: Mapped[int | None] = mapped_column(Integer)
    stats: Mapped[dict[str, Any]] = mapped_column(default=dict)
    accepted_rollouts: Mapped[int] = mapped_column(Integer, default=0)
    rejected_rollouts: Mapped[int] = mapped_column(Integer, default=0)
    # Distinct other providers that reported bad chunks from this worker's relay (services/relay.py).
    bad_chunks: Mapped[int] = mapped_column(Integer, default=0)
    relay_confirmed_bad_at: Mapped[datetime | None]  # the control plane fetched a bad chunk itself
    relay_probed_at: Mapped[datetime | None]
    measured_upload_mbps: Mapped[float | None] = mapped_column(Float)  # from other providers' downloads
    versions_held: Mapped[list[Any]] = mapped_column(default=list)  # complete versions of its job on disk
    earned_usd: Mapped[float] = mapped_column(Float, default=0.0)
    active_since: Mapped[datetime | None]
    # Trust (api/services/trust.py): the learner's audits and the door's checks move a worker along
    # probation -> trusted <-> suspect -> quarantined -> banned.
    trust: Mapped[TrustState] = mapped_column(stored_as_value(TrustState), default=TrustState.probation)
    audits_passed: Mapped[int] = mapped_column(Integer, default=0)
    audits_failed: Mapped[int] = mapped_column(Integer, default=0)
    strikes: Mapped[int] = mapped_column(Integer, default=0)  # failures since it was last in good standing
    clean_streak: Mapped[int] = mapped_column(Integer, default=0)  # audits passed in a row
    # The worker of its provider whose strikes it started with (api/services/trust.py::inherit_strikes).
    inherited_from: Mapped[str | None] = mapped_column(String(32))
    quarantines: Mapped[int] = mapped_column(Integer, default=0)
    quarantined_until: Mapped[datetime | None]
    trust_reason: Mapped[str | None] = mapped_column(String(512))
    evidence: Mapped[dict[str, Any]] = mapped_column(default=dict)  # sequential tests (api/services/evidence.py)
    # Which of a trusted worker's groups are audited (trust.should_audit): its accepted groups are
    # numbered in arrival order, and this secret, never sent to it, picks one per window.
    groups_numbered: Mapped[int] = mapped_column(Integer, default=0)
    audit_salt: Mapped[str] = mapped_column(String(32), default=lambda: secrets.token_hex(16))
    # Pay for work (scheduler/billing.py): the rate it was activated for, and active time not yet paid.
    activated_mu: Mapped[float | None] = mapped_column(Float)
    trial_failed_at: Mapped[datetime | None]  # activated on its claims, delivered nothing (scheduler/reconcile.py)
    # job id -> seconds: each job pays only for the time the worker was active on it
    unbilled: Mapped[dict[str, Any]] = mapped_column(default=dict)
    last_heartbeat_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class RelayReport(Base):
    """A worker's report that chunks from another worker's relay failed verification."""

    __tablename__ = "relay_reports"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    reported_worker_id: Mapped[str] = mapped_column(String(32), index=True)
    reporter_worker_id: Mapped[str] = mapped_column(String(32))
    reporter_provider_id: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (UniqueConstraint("reported_worker_id", "reporter_provider_id"),)


class RelayMeasurement(Base):
    """What one provider's workers measured downloading from a relay (an average weighted toward the latest):
    the relay's rate is the median over providers (services/relay.py)."""

    __tablename__ = "relay_measurements"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    relay_worker_id: Mapped[str] = mapped_column(String(32), index=True)
    provider_id: Mapped[str] = mapped_column(String(32))
    mbps: Mapped[float] = mapped_column(Float)
    measured_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (UniqueConstraint("relay_worker_id", "provider_id"),)


class Dataset(Base):
    __tablename__ = "datasets"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("ds"))
    owner_id: Mapped[str] = mapped_column(ForeignKey("users.id"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    num_items: Mapped[int] = mapped_column(Integer)
    keys: Mapped[list[Any]]
    sha256: Mapped[str | None] = mapped_column(String(64), default=None)  # of the file it was uploaded from in parts
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class DatasetItem(Base):
    __tablename__ = "dataset_items"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    data: Mapped[dict[str, Any]]
    __table_args__ = (UniqueConstraint("dataset_id", "index"),)


class DatasetUpload(Base):
    """A JSONL file on its way in, in parts (api/services/uploads.py); it becomes a dataset when complete."""

    __tablename__ = "dataset_uploads"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("upl"))
    owner_id: Mapped[str] = mapped_column(ForeignKey("users.id"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    part_size: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("job"))
    owner_id: Mapped[str] = mapped_column(ForeignKey("users.id"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    status: Mapped[JobStatus] = mapped_column(stored_as_value(JobStatus), default=JobStatus.queued, index=True)
    status_reason: Mapped[str | None] = mapped_column(String(512))
    spec: Mapped[dict[str, Any]]
    step: Mapped[int] = mapped_column(Integer, default=0)
    version: Mapped[int | None] = mapped_column(Integer)
    final_version: Mapped[int | None] = mapped_column(Integer)
    num_prompts: Mapped[int] = mapped_column(Integer, default=0)
    reward_mean: Mapped[float | None] = mapped_column(Float)
    learner_usd: Mapped[float] = mapped_column(Float, default=0.0)
    workers_usd: Mapped[float] = mapped_column(Float, default=0.0)
    learner_busy_s: Mapped[float] = mapped_column(Float, default=0.0)
    learner_wall_s: Mapped[float] = mapped_column(Float, default=0.0)
    # What the job's earlier learner processes reported (each counts from its own start): the two above add it.
    learner_busy_before_s: Mapped[float] = mapped_column(Float, default=0.0)
    learner_wall_before_s: Mapped[float] = mapped_column(Float, default=0.0)
    learner_heartbeat_at: Mapped[datetime | None]
    learner_launched_at: Mapped[datetime | None]
    learner_launches: Mapped[int] = mapped_column(Integer, default=0)
    # Launches in a row that ended without a committed step: the job fails after a few (a crash loop).
    learner_failures: Mapped[int] = mapped_column(Integer, default=0)
    learner_failure_step: Mapped[int | None] = mapped_column(Integer)
    learner_error: Mapped[str | None] = mapped_column(String(512))
    learner_crashed_at: Mapped[datetime | None]
    # From the first published version's config (api/services/versions.py): bounds for the door's checks.
    vocab_size: Mapped[int | None] = mapped_column(Integer)
    context_length: Mapped[int | None] = mapped_column(Integer)  # prompt and completion tokens, at most
    eos_token_ids: Mapped[list[Any] | None]
    # The learner's latest checkpoint stored through the control plane (api/routes/learner_state.py):
    # a relaunched learner loads it and replays the steps committed since.
    checkpoint_step: Mapped[int | None] = mapped_column(Integer)
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    # Never leaves the control plane: each version's relay key is derived from it (services.fleet).
    relay_secret: Mapped[str] = mapped_column(String(64), default=lambda: secrets.token_hex(32))
    # A queued job's place among those waiting for a learner slot (1 = next), set by each reconcile tick.
    queue_position: Mapped[int | None] = mapped_column(Integer)
    # Why a paused job is paused: "budget" (resumes when the budget is raised), "quota" (by itself) or "reward"
    # (its task could not score its groups; resumed by its owner).
    paused_for: Mapped[PauseCause | None] = mapped_column(stored_as_value(PauseCause))
    # Claimed groups in a row its task could not score (learning.commit_step): it pauses at reward_failures_to_pause.
    reward_failures: Mapped[int] = mapped_column(Integer, default=0)
    # The cost estimated when the job was submitted (api/services/estimate.py), to compare with the actual.
    estimate_usd: Mapped[float | None] = mapped_column(Float)
    # GiB a rollout worker must offer: spec.workers.memory_gb, or derived from the first version (modelinfo).
    memory_need_gb: Mapped[float | None] = mapped_column(Float)
    # GiB each of its learner's GPUs needs, estimated at submission from the model's config (services/memory.py).
    learner_memory_gib: Mapped[float | None] = mapped_column(Float)
    # Where its learner was last launched: {"host", "slots", "devices"} (scheduler/queue.py).
    learner_placement: Mapped[dict[str, Any] | None]
    kind: Mapped[JobKind] = mapped_column(stored_as_value(JobKind), default=JobKind.grpo)
    # A tinker_fleet job's model (api/tinker/fleet.py): its versions are the model's sampler checkpoints.
    tinker_model_id: Mapped[str | None] = mapped_column(String(96), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    __table_args__ = (UniqueConstraint("owner_id", "idempotency_key"),)


class Prompt(Base):
    """A prompt of a job. `order_key` is a seeded permutation: the server, not the worker, picks. A held-out
    prompt has state "eval" from the start and keeps it: the pool never leases it (services/evals.py)."""

    __tablename__ = "prompts"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)
    reference: Mapped[str | None] = mapped_column(Text)
    # A chat item's turns before its last user turn (system, earlier turns), rendered with `text` as that turn
    # by the model's chat template (echo2.prompting.encode_prompt).
    context: Mapped[list[Any] | None]
    state: Mapped[PromptState] = mapped_column(stored_as_value(PromptState), default=PromptState.available)
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    order_key: Mapped[int] = mapped_column(BigInteger)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    lease_id: Mapped[str | None] = mapped_column(String(32), index=True)
    # A Tinker sample request's prompt (api/tinker/fleet.py): its tokens, its own sampling, the version (its
    # checkpoint) it must be drawn with, and the request whose future its group answers.
    token_ids: Mapped[list[Any] | None]
    sampling: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    version: Mapped[int | None] = mapped_column(Integer)
    request_id: Mapped[str | None] = mapped_column(String(40), index=True)
    __table_args__ = (
        UniqueConstraint("job_id", "index"),
        Index("ix_prompts_pool", "job_id", "state", "epoch", "order_key"),
    )


class Lease(Base):
    __tablename__ = "leases"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("lse"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    worker_id: Mapped[str] = mapped_column(ForeignKey("workers.id"), index=True)
    status: Mapped[LeaseStatus] = mapped_column(stored_as_value(LeaseStatus), default=LeaseStatus.active)
    version: Mapped[int] = mapped_column(Integer)
    step_at_lease: Mapped[int] = mapped_column(Integer)
    prompt_ids: Mapped[list[Any]]
    expires_at: Mapped[datetime]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]
    __table_args__ = (Index("ix_leases_expiry", "status", "expires_at"), Index("ix_leases_job", "job_id", "status"),
                      Index("ix_leases_worker", "worker_id", "created_at"))  # the lease idle rule (pool.idle_seconds)


ENV_FAILED = text(f"reject_kind = '{RejectKind.environment_failed.value}'")


class Rollout(Base):
    """One prompt's group of G samples, tagged with the version that generated it."""

    __tablename__ = "rollouts"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("rol"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    prompt_id: Mapped[int] = mapped_column(ForeignKey("prompts.id", ondelete="CASCADE"))
    lease_id: Mapped[str] = mapped_column(ForeignKey("leases.id", ondelete="CASCADE"))
    worker_id: Mapped[str] = mapped_column(String(32), index=True)
    version: Mapped[int] = mapped_column(Integer)
    status: Mapped[RolloutStatus] = mapped_column(stored_as_value(RolloutStatus))
    reason: Mapped[str | None] = mapped_column(String(256))
    prompt_token_ids: Mapped[list[Any]]
    samples: Mapped[list[Any]]
    rewards: Mapped[list[Any] | None]
    # The learner's own logprob of each token of each sample when it trained the group (learner/traces.py).
    learner_logprobs: Mapped[list[Any] | None]
    gen_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    reject_kind: Mapped[RejectKind | None] = mapped_column(stored_as_value(RejectKind, 24))
    audit: Mapped[AuditVerdict | None] = mapped_column(stored_as_value(AuditVerdict))  # None: not audited
    seq: Mapped[int | None] = mapped_column(Integer)  # the sender's n-th accepted group (Worker.groups_numbered)
    seed: Mapped[int | None] = mapped_column(BigInteger)  # the prompt's leased base seed, which the audit replays
    precision: Mapped[Precision | None] = mapped_column(stored_as_value(Precision))  # its worker's logits dtype
    suspicion: Mapped[str | None] = mapped_column(String(64))  # what the door saw that gets it audited anyway
    paid_entry_id: Mapped[int | None] = mapped_column(BigInteger, index=True)
    claim_step: Mapped[int | None] = mapped_column(Integer)
    trained_step: Mapped[int | None] = mapped_column(Integer)
    # The archive file holding prompt_token_ids, samples and learner_logprobs once nothing reads them from
    # this table and they left it (api/services/archive.py); None: they are here.
    archive: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (
        UniqueConstraint("lease_id", "prompt_id"),
        Index("ix_rollouts_queue", "job_id", "status", "version", "created_at"),
        # The newest trained groups of a job: the fleet comparison's window and the archive sweep's edge.
        Index("ix_rollouts_trained", "job_id", "status", "trained_step"),
        # A prompt's environment failures, by whom: setting the prompt aside and paying for them need two providers.
        Index("ix_rollouts_env_failed", "prompt_id", postgresql_where=ENV_FAILED, sqlite_where=ENV_FAILED),
    )


class Episode(Base):
    """One sample of a multi-turn group, played turn by turn through the control plane: the worker's
    actions (as tokens, decoded here) and the environment's replies (as tokens, issued here). The
    environment is rebuilt from the prompt and replayed over `actions` at each turn (tasks/base.py)."""

    __tablename__ = "episodes"
    lease_id: Mapped[str] = mapped_column(ForeignKey("leases.id", ondelete="CASCADE"), primary_key=True)
    prompt_id: Mapped[int] = mapped_column(ForeignKey("prompts.id", ondelete="CASCADE"), primary_key=True)
    sample: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    actions: Mapped[list[Any]]  # the decoded text of each model turn
    turns: Mapped[list[Any]]  # token-id lists, alternating: action, observation, action, ...
    done: Mapped[bool] = mapped_column(default=False)
    reward: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(String(512))  # why the environment could not go on
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class WeightVersion(Base):
    __tablename__ = "weight_versions"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer)
    # The full form (a keyframe), null when the version was published only as a delta.
    manifest: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))  # SQL NULL, not 'null'
    manifest_sha256: Mapped[str | None] = mapped_column(String(64))
    total_size: Mapped[int | None] = mapped_column(BigInteger)
    num_chunks: Mapped[int | None] = mapped_column(Integer)
    # The delta against the version published before it (echo2.deltas), null for a job's first version.
    delta_manifest: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    delta_size: Mapped[int | None] = mapped_column(BigInteger)
    delta_base: Mapped[int | None] = mapped_column(Integer)
    adapter_base: Mapped[int | None] = mapped_column(Integer)  # a LoRA adapter version: the base it applies to
    # Secret ranges of the version and their sha256 (echo2.possession), never in a response; null when
    # published without: then a worker holds it when its heartbeat says so (api/services/possession.py).
    probes: Mapped[list[Any] | None] = mapped_column(JSON(none_as_null=True))
    publish_seconds: Mapped[float | None] = mapped_column(Float)
    # Workers active on the job when it was announced: dissemination is done when they hold it.
    targets: Mapped[list[Any]] = mapped_column(default=list)
    collected_at: Mapped[datetime | None]  # weights deleted (api/services/retention.py); the row stays
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class VersionHold(Base):
    """When a worker first held a version: for a version with probes, when it proved it (the hold is
    recorded then, `proven_at` set); for one without, its first heartbeat reporting it (a claim)."""

    __tablename__ = "version_holds"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    worker_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    held_at: Mapped[datetime] = mapped_column(default=utcnow)
    proven_at: Mapped[datetime | None]


class StepMetric(Base):
    __tablename__ = "step_metrics"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    t_train_s: Mapped[float] = mapped_column(Float)
    reward_mean: Mapped[float | None] = mapped_column(Float)
    reward_std: Mapped[float | None] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float)
    kl: Mapped[float | None] = mapped_column(Float)
    clip_frac: Mapped[float | None] = mapped_column(Float)
    groups: Mapped[int] = mapped_column(Integer)
    groups_dropped: Mapped[int] = mapped_column(Integer)
    groups_rejected: Mapped[int] = mapped_column(Integer, default=0)  # refused by the learner (sender's fault)
    groups_unscored: Mapped[int] = mapped_column(Integer, default=0)  # its task could not score them (platform's)
    audits: Mapped[int] = mapped_column(Integer, default=0)
    audit_s: Mapped[float] = mapped_column(Float, default=0.0)
    rollout_ids: Mapped[list[Any]] = mapped_column(default=list)  # trained, in the learner's order (replay)
    staleness_hist: Mapped[list[Any]]
    # behaviour against learner per staleness, then the whole step (echo2.protocol.MismatchStats)
    mismatch: Mapped[list[Any]] = mapped_column(default=list)
    tokens: Mapped[int] = mapped_column(BigInteger)
    learner_utilization: Mapped[float | None] = mapped_column(Float)
    rollouts_per_s: Mapped[float | None] = mapped_column(Float)
    cost_usd: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class EvalResult(Base):
    """Held-out accuracy of one version (the learner's report), for a job's eval curve."""

    __tablename__ = "eval_results"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    prompts: Mapped[int] = mapped_column(Integer)
    greedy_accuracy: Mapped[float | None] = mapped_column(Float)
    sampled_accuracy: Mapped[float | None] = mapped_column(Float)
    sampled_reward_mean: Mapped[float | None] = mapped_column(Float)
    greedy_answers: Mapped[list[Any] | None]  # in the order of the held-out prompts
    seconds: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class LedgerEntry(Base):
    """Money moving: a worker paid for the rollouts named here, or a learner for its time."""

    __tablename__ = "ledger_entries"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[LedgerKind] = mapped_column(stored_as_value(LedgerKind))
    worker_id: Mapped[str | None] = mapped_column(String(32), index=True)
    provider_id: Mapped[str | None] = mapped_column(String(32), index=True)
    amount_usd: Mapped[float] = mapped_column(Float)
    seconds: Mapped[float] = mapped_column(Float)  # billed time
    groups: Mapped[int] = mapped_column(Integer, default=0)
    rollout_ids: Mapped[list[Any]] = mapped_column(default=list)
    step: Mapped[int | None] = mapped_column(Integer)  # the job's step when the entry was made
    memo: Mapped[str | None] = mapped_column(String(256))  # what it pays for, in words
    clawed_back_by: Mapped[int | None] = mapped_column(BigInteger)  # the clawback entry that reversed this one
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Audit(Base):
    """The learner's re-scoring of one worker's group under the version it claimed: the evidence a
    quarantine or ban points to."""

    __tablename__ = "audits"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    worker_id: Mapped[str] = mapped_column(String(32), index=True)
    rollout_id: Mapped[str] = mapped_column(String(32))
    version: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    passed: Mapped[bool]
    reason: Mapped[str | None] = mapped_column(String(512))
    stats: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Decision(Base):
    """One line of an activation decision, with the inputs it was made from (for explanations)."""

    __tablename__ = "decisions"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str | None] = mapped_column(String(32), index=True)
    worker_id: Mapped[str] = mapped_column(String(32))
    action: Mapped[Action] = mapped_column(stored_as_value(Action))
    line: Mapped[str] = mapped_column(String(512))
    trigger: Mapped[str] = mapped_column(String(256))
    inputs: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Decisions are stored as changes: re-solves that decide the same action again add to this row's run
    # (scheduler/reconcile.py); line, trigger and inputs are then the newest one's.
    repeats: Mapped[int] = mapped_column(Integer, default=1)
    decided_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (Index("ix_decisions_runs", "job_id", "worker_id"),)


class LearnerHost(Base):
    """A learner host (a Celery worker on its own queue) and how many learners it runs at once;
    it re-registers every few seconds, and the scheduler launches learners only into free slots."""

    __tablename__ = "learner_hosts"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    slots: Mapped[int] = mapped_column(Integer)
    # Slot i's GPU on a host with GPUs ({"id", "name", "memory_gib"}: scheduler/hosts.py); empty on a CPU host.
    gpus: Mapped[list[Any] | None]
    seen_at: Mapped[datetime] = mapped_column(default=utcnow)


class SchedulerState(Base):
    """Small named JSON values the reconcile loop carries between ticks (solver state, last tick)."""

    __tablename__ = "scheduler_state"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[dict[str, Any]]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
