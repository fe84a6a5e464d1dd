"""Shared building blocks of the wire protocol: bounded scalar types, enums and pages.

Every string has a max length, every list a max size, every number a range (STYLE.md #3),
so the control plane can reject oversized input before it touches the database.
"""

from __future__ import annotations

import math
import unicodedata
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Generic, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints
from pydantic_core import ErrorDetails


def reason(error: ErrorDetails) -> str:
    """What one validation error says, without the "Value error, " pydantic puts before our validators' own words."""
    cause = error.get("ctx", {}).get("error") if error["type"] == "value_error" else None
    return str(cause) if cause is not None else error["msg"]


def _no_nul(value: str) -> str:
    # PostgreSQL text cannot hold NUL, and no legitimate prompt, name or URL needs one.
    if "\x00" in value:
        raise ValueError("must not contain NUL (\\x00) characters")
    return value


def _finite(value: object) -> object:
    # Python's json module, which parses request bodies, reads NaN and ±Infinity; no field means them,
    # and a JSON column cannot hold them. Checked before a union so the one error names the field.
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite number, not NaN or Infinity")
    return value


# Bidirectional embeddings, overrides and isolates, and the marks: in a name they make it display as another
# ("gpu-1" reading backwards as a trusted provider's) in the dashboard's and the CLI's lists.
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _plain(value: str) -> str:
    for i, ch in enumerate(value):
        if ch in _BIDI or unicodedata.category(ch) == "Cc":
            raise ValueError(f"must not contain control or bidirectional-formatting characters (U+{ord(ch):04X} "
                             f"at position {i}): a name shows as it is written")
    return value


NoNul = AfterValidator(_no_nul)
Finite = BeforeValidator(_finite)
Id = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]
Name = Annotated[str, StringConstraints(min_length=1, max_length=128, strip_whitespace=True), NoNul,
                 AfterValidator(_plain)]
Text = Annotated[str, StringConstraints(max_length=32_768), NoNul]
Key = Annotated[str, StringConstraints(max_length=64), NoNul]
Url = Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=r"^https?://[^\s\x00]+$")]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
ShortText = Annotated[str, StringConstraints(max_length=512), NoNul]
Price = Annotated[float, Field(ge=0, le=10_000)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
MIN_LOGPROB = -1e4  # the floor of a sample's logprobs: a sampled token is never that unlikely in practice
Logprob = Annotated[float, Field(ge=MIN_LOGPROB, le=0.0)]
Version = Annotated[int, Field(ge=0, le=10_000_000)]
Step = Annotated[int, Field(ge=0, le=10_000_000)]

Scalar = Annotated[int | float | bool | Annotated[str, StringConstraints(max_length=2048), NoNul], Finite]
ParamValue = Scalar | Annotated[list[Scalar], Field(max_length=64)] | None


class Model(BaseModel):
    """Base of every wire model: unknown fields are an error, not silently dropped, and no float may be
    NaN or infinite."""

    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)


class ReadModel(BaseModel):
    """Base of response models: tolerant of fields added by newer servers."""

    model_config = ConfigDict(extra="ignore", from_attributes=True)


T = TypeVar("T")


class Page(ReadModel, Generic[T]):
    """One page of a listing; pass `next_offset` back as `offset` to get the next one."""

    items: list[T]
    total: int = Field(ge=0)
    next_offset: int | None = Field(default=None, ge=0)


class Problem(ReadModel):
    """RFC 9457 problem details, the body of every 4xx/5xx answer."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    errors: list[FieldError] = Field(default_factory=list)


class FieldError(ReadModel):
    field: str
    reason: str


class JobStatus(StrEnum):
    queued = "queued"  # waiting for a learner slot or for its owner's quota (see status_reason)
    running = "running"
    paused = "paused"  # its budget ran out (resumes when raised), its owner's daily quota did (by itself), or its
    # task could not score its groups (resumed by its owner: POST /v1/jobs/{id}/resume)
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    def is_terminal(self) -> bool:
        return self in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)

    @classmethod
    def ended(cls) -> list[JobStatus]:
        """The terminal statuses (for a query's IN)."""
        return [s for s in cls if s.is_terminal()]

    @classmethod
    def live(cls) -> list[JobStatus]:
        return [s for s in cls if not s.is_terminal()]

    def stops_learner(self) -> bool:
        """A learner that sees this status stops: finished, or paused (a new one resumes the job later)."""
        return self is JobStatus.paused or self.is_terminal()


class JobKind(StrEnum):
    """What trains a job and where its prompts come from."""

    grpo = "grpo"  # its own learner trains it with GRPO on its task's prompts, epoch after epoch
    # A Tinker model's fleet sampler (api/tinker/fleet.py): no learner of its own (the Tinker host publishes its
    # versions, the model's sampler checkpoints) and no task: its prompts are the sample requests on them.
    tinker_fleet = "tinker_fleet"

    @property
    def has_learner(self) -> bool:
        """The scheduler queues it for a learner slot and launches one."""
        return self is JobKind.grpo

    @property
    def has_task(self) -> bool:
        """Its prompts come from a task: epochs refill the pool, multi-turn tasks play episodes, and a lease is
        bounded by what the learner can train before the version goes stale."""
        return self is JobKind.grpo


class PromptState(StrEnum):
    """Where one of a job's prompts is in the pool (api/services/pool.py)."""

    available = "available"  # may be leased
    leased = "leased"  # in a worker's lease
    submitted = "submitted"  # its group arrived and waits for the learner
    trained = "trained"  # the learner trained its group this epoch
    eval = "eval"  # held out for evaluation: never leased (api/services/evals.py)
    set_aside = "set_aside"  # never leased again, and no epoch waits for it
    host = "host"  # a Tinker fleet prompt whose request went to the learner host: no worker leases it


class PauseCause(StrEnum):
    """Why a paused job is paused (Job.paused_for)."""

    budget = "budget"  # resumes when its owner raises the budget
    quota = "quota"  # resumes by itself when its owner's daily quota allows
    reward = "reward"  # its task could not score its groups: resumed by its owner (POST /v1/jobs/{id}/resume)


class AuditVerdict(StrEnum):
    """What the learner's audit of a rollout said (Rollout.audit; None: not audited)."""

    passed = "passed"
    failed = "failed"
    pending = "pending"  # a Tinker fleet group waiting for the host's audit (api/tinker/fleet.py)


class Role(StrEnum):
    admin = "admin"
    user = "user"


class WorkerStatus(StrEnum):
    idle = "idle"
    active = "active"
    draining = "draining"
    offline = "offline"
    deregistered = "deregistered"

    def is_terminal(self) -> bool:
        return self is WorkerStatus.deregistered


class DesiredState(StrEnum):
    idle = "idle"
    active = "active"
    drain = "drain"


class LeaseStatus(StrEnum):
    active = "active"
    completed = "completed"
    expired = "expired"
    released = "released"

    def is_terminal(self) -> bool:
        return self is not LeaseStatus.active


class RolloutStatus(StrEnum):
    accepted = "accepted"
    claimed = "claimed"
    trained = "trained"
    rejected = "rejected"


class TrustState(StrEnum):
    """Where a worker stands after the learner's audits of its rollouts (api/services/trust.py)."""

    probation = "probation"  # new: every group audited until it has passed enough audits
    trusted = "trusted"  # a sampled fraction of its groups is audited
    suspect = "suspect"  # failed a check lately: every group audited again
    quarantined = "quarantined"  # no leases until its quarantine ends; its queued rollouts were discarded
    banned = "banned"  # failed again after a quarantine: never leased to again

    def can_work(self) -> bool:
        return self not in (TrustState.quarantined, TrustState.banned)

    @classmethod
    def working(cls) -> list[TrustState]:
        """The states that may be leased work (for `Worker.trust.in_(...)`)."""
        return [s for s in cls if s.can_work()]


class Fault(StrEnum):
    """Whose fault a rejected rollout is. Only `worker` counts against the worker's trust; only
    `platform` is still paid (the worker delivered what was asked, in time), and not all of it
    (`RejectKind.paid`)."""

    worker = "worker"
    late = "late"  # not paid, no strike
    platform = "platform"


class RejectKind(StrEnum):
    """Why a rollout was rejected, as data (its `reason` says it in words for people)."""

    lease_ended = "lease_ended"  # arrived after its lease expired or was released
    stale_at_submit = "stale_at_submit"  # its version was already too old when it arrived
    stale_at_claim = "stale_at_claim"  # accepted in time, not trained before its version went stale
    invalid = "invalid"  # refused at the door: does not fit the job or the model
    audit_failed = "audit_failed"  # the learner's re-scoring under the claimed version disagreed
    refused_by_learner = "refused_by_learner"  # tokens that do not fit the model, or a poisoned loss
    sender_shut_out = "sender_shut_out"  # still queued when its sender was quarantined or banned
    environment_failed = "environment_failed"  # a multi-turn task's environment raised or timed out
    reward_failed = "reward_failed"  # the learner's task could not score it (endpoint down, exception, timeout)

    def fault(self) -> Fault:
        if self in (RejectKind.stale_at_claim, RejectKind.environment_failed, RejectKind.reward_failed):
            return Fault.platform
        if self in (RejectKind.lease_ended, RejectKind.stale_at_submit):
            return Fault.late
        return Fault.worker

    def paid(self) -> bool:
        """Whether a group rejected so is still paid, and counts as delivered: the platform's fault, but for a group
        that went stale before the learner claimed it. No audit ever saw one, so a worker could hold junk back on a
        renewed lease until its version was about to go stale, send it then, and be paid for it."""
        return self.fault() is Fault.platform and self is not RejectKind.stale_at_claim


class Precision(StrEnum):
    """The dtype a worker computed its logits in: the replay audit's margin for numerical differences
    depends on it (learner/audit.py)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Backend(StrEnum):
    transformers = "transformers"
    vllm = "vllm"


class Timestamped(ReadModel):
    created_at: datetime


Problem.model_rebuild()
