"""Providers, workers and their heartbeat: how the rollout plane joins and is told what to do."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field, StringConstraints, field_validator

from .common import (
    Backend,
    DesiredState,
    Id,
    Model,
    Name,
    NoNul,
    Price,
    ReadModel,
    Sha256,
    ShortText,
    TrustState,
    Url,
    Version,
    WorkerStatus,
)
from .weights import PROBE_BYTES, Form

Label = Annotated[str, StringConstraints(max_length=64), NoNul]


class ProviderCreate(Model):
    name: Name
    contact: Annotated[str, StringConstraints(max_length=256), NoNul] | None = None


class ProviderRead(ReadModel):
    id: str
    name: str
    contact: str | None = None
    num_workers: int = 0
    earnings_usd: float = Field(0.0, description="Paid so far, less what was clawed back from workers caught "
                                "forging (it may be negative: owed).")
    watch_until: datetime | None = Field(None, description="While one of its workers is quarantined, the provider "
                                         "is on watch: every group of each of its workers is audited, and none "
                                         "leaves probation.")
    banned_at: datetime | None = Field(None, description="A worker of the provider was banned: the provider is too; "
                                       "it registers no more workers.")
    standing_reason: str | None = None
    created_at: datetime


class ProviderCreated(ReadModel):
    provider: ProviderRead
    token: str = Field(description="Provider token (shown once): workers register with it.")


class WorkerRegister(Model):
    name: Name
    gpu_model: Label = Field("cpu", description="e.g. `H100`, `RTX 4090`, `cpu`.")
    gpu_count: int = Field(0, ge=0, le=64)
    vram_gb: float = Field(0, ge=0, le=4096, description="GiB the worker generates in: its GPU's VRAM, or a CPU "
                           "worker's RAM. A job needing more never gets the worker.")
    price_per_hour: Price = 0.0
    region: Label = "local"
    upload_mbps: float = Field(100.0, ge=0, le=1_000_000, description="Claimed upload bandwidth (Mbit/s), shown "
                               "only: relay placement uses the rate other providers' workers measure.")
    download_mbps: float = Field(100.0, ge=0, le=1_000_000)
    max_upload_mbps: float | None = Field(None, ge=0, le=1_000_000, description="Cap on relay upload rate.")
    relay_url: Url | None = Field(None, description="Where peers can fetch chunks from; null = leaf only. With "
                                  "ECHO2_ENV=production it must be a public http(s) address.")
    backends: list[Backend] = Field(default_factory=lambda: [Backend.transformers], min_length=1, max_length=4)
    rollouts_per_s: float = Field(0.0, ge=0, le=1_000_000, description="Benchmarked μ (groups/s), a claim: an "
                                  "unmeasured worker counts for a small trial share of any job's need.")
    tokens_per_s: float = Field(0.0, ge=0, le=1e9)
    software: Label = "echo2-worker"


class WorkerRead(ReadModel):
    id: str
    provider_id: str
    name: str
    gpu_model: str
    gpu_count: int
    vram_gb: float
    price_per_hour: float
    region: str
    upload_mbps: float
    download_mbps: float
    relay_url: str | None
    backends: list[Backend]
    status: WorkerStatus
    desired: DesiredState
    job_id: str | None
    version_held: int | None
    rollouts_per_s: float
    accepted_rollouts: int = 0
    rejected_rollouts: int = 0
    bad_chunks: int = Field(0, description="Distinct other providers whose workers reported bad chunks from this "
                            "worker's relay; at ECHO2_RELAY_MAX_BAD_CHUNKS it serves no peer.")
    relay_confirmed_bad_at: datetime | None = Field(None, description="When the control plane fetched a chunk from "
                                                    "this relay itself and found it corrupt: it serves no peer.")
    measured_upload_mbps: float | None = Field(None, description="Upload rate other providers' workers on its job "
                                               "measured downloading from this relay (the median over providers); "
                                               "relay placement goes by it.")
    trust: TrustState = Field(TrustState.probation, description="Standing after the learner's audits and the "
                              "door's checks: probation, trusted, suspect, quarantined or banned.")
    audits_passed: int = 0
    audits_failed: int = 0
    quarantined_until: datetime | None = None
    trust_reason: str | None = Field(None, description="The latest evidence behind the trust state; "
                                     "GET /v1/workers/{id}/audits lists every audit.")
    last_heartbeat_at: datetime | None
    created_at: datetime


class PlacementLine(ReadModel):
    """The scheduler's newest decision about a worker on one job, e.g. "skipped w9: VRAM 8 GiB < need 11.5 GiB" or
    "idle w3: qualifies but not needed": why a worker is where it is, for its provider."""

    job_id: str | None
    action: str
    line: str
    decided_at: datetime


class WorkerRegistered(ReadModel):
    worker: WorkerRead
    token: str = Field(description="Per-worker token (shown once).")
    heartbeat_interval_s: float
    lease_ttl_s: float


class PlatformVersion(ReadModel):
    """What a control plane runs, and where a worker of the same version installs from (its package index)."""

    version: str = Field(description="The platform's version (echo2-server).")
    packages: dict[str, str] = Field(description="Each distribution it serves, by name, at its version.")
    index_url: str = Field(description="Its PEP 503 package index: `pip install --index-url INDEX_URL "
                           "'echo2-worker[cpu]'`.")


class BadSource(Model):
    url: Url
    reason: ShortText


class Fetched(Model):
    """What a download took from one source: the control plane measures relays' upload rates by it."""

    url: Url
    bytes: int = Field(ge=0, le=2**42)
    seconds: float = Field(ge=0, le=86_400)


class WorkerStats(Model):
    rollouts_done: int = Field(0, ge=0, le=10**12)
    tokens_per_s: float = Field(0, ge=0, le=1e9)
    upload_bytes_per_s: float = Field(0, ge=0, le=1e12)
    download_bytes_per_s: float = Field(0, ge=0, le=1e12)
    last_download_s: float | None = Field(None, ge=0, le=1e6, description="Time to fetch the last version.")


class Challenge(ReadModel):
    """Prove that you hold `version`: hash these bytes of your copy (echo2.possession.answer)."""

    version: int
    offset: int
    length: int


class Proof(Model):
    """The answer to a Challenge: the sha256 of its bytes, read from the worker's copy of the version."""

    version: Version
    offset: int = Field(ge=0, le=2**42)
    length: int = Field(ge=1, le=PROBE_BYTES)
    sha256: Sha256


REPORTED = (WorkerStatus.idle, WorkerStatus.active, WorkerStatus.draining)


class Heartbeat(Model):
    status: WorkerStatus = Field(WorkerStatus.idle, description="`idle`, `active` or `draining`: `offline` and "
                                 "`deregistered` are the control plane's to set (DELETE /v1/workers/{id} leaves).")
    job_id: Id | None = None
    version_held: Version | None = None
    versions_held: list[Version] = Field(default_factory=list, max_length=8, description="Every complete version "
                                         "of the job on disk: a lease is granted only at a version reported here "
                                         "(and proven, when the reply challenged it).")
    proofs: list[Proof] = Field(default_factory=list, max_length=8, description="Answers to the challenges of the "
                                "last reply. A wrong answer is a strike; one that answers no open challenge is "
                                "ignored.")
    stats: WorkerStats = Field(default_factory=WorkerStats)
    bad_sources: list[BadSource] = Field(default_factory=list, max_length=32)
    fetched_from: list[Fetched] = Field(default_factory=list, max_length=16,
                                        description="Per source, what the last download took from it.")

    @field_validator("status")
    @classmethod
    def _reported(cls, status: WorkerStatus) -> WorkerStatus:
        # A worker that called itself offline escaped the offline sweep and the scheduler but kept its job and
        # leases (renewing them without a beat); one that called itself deregistered kept its tokens.
        if status not in REPORTED:
            raise ValueError(f"a worker reports idle, active or draining, not {status.value}: offline and "
                             "deregistered are the control plane's to set (DELETE /v1/workers/{id} to leave)")
        return status


class SamplingParams(ReadModel):
    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int = 0
    partial_rollouts: bool = Field(False, description="The job's `partial_rollouts`: swap to a newer version between "
                                   "segments of a generation and tag each sample's tokens with their versions.")


class FetchStep(ReadModel):
    version: int
    form: Form
    manifest_url: str
    size: int = Field(description="Bytes to download for this step.")
    shared: bool = Field(False, description="A base model LoRA adapters apply to: keep it by the digest of its "
                         "files, for every job on the same base.")


class Assignment(ReadModel):
    job_id: str
    version: int = Field(description="Version to hold: the newest published one.")
    min_version: int = Field(
        description="Oldest version whose rollouts are still admissible now. When it exceeds `version` (S = 0 "
        "right after a step), nothing admissible can be generated yet: wait for the next version."
    )
    staleness: int
    fetch: list[FetchStep] = Field(description="What to download, in order, to hold `version`: the fewest bytes "
                                   "from the versions your last heartbeat reported holding (deltas after one of "
                                   "them, or a keyframe and the deltas after it). Empty when you hold it.")
    relay_parents: list[str] = Field(description="Peers to fetch the last step's chunks from, best first; the origin "
                                     "is last. Earlier steps come from the origin.")
    relay_key: str = Field(
        min_length=64, max_length=64,
        description="Bearer credential for this version on relay peers: send it (never the worker token) "
        "when fetching from a peer, and accept only it on your own relay for this version.",
    )
    sampling: SamplingParams
    lora_rank: int | None = Field(None, description="Rank of the adapter the job trains (LoRA jobs): every version "
                                  "after the first is an adapter on version 0, so a backend that must be built "
                                  "for adapters (vLLM) can be from the first version on.")
    challenges: list[Challenge] = Field(default_factory=list, description="One per version of the job your last "
                                        "heartbeat listed in `versions_held` but has not proven: answer each in "
                                        "`proofs` of your next heartbeat (at once). No lease at a version until "
                                        "then.")


class HeartbeatReply(ReadModel):
    desired: DesiredState
    assignment: Assignment | None = None
    notice: str | None = Field(None, description="Something the worker's operator should read, e.g. why it is "
                               "quarantined or banned.")
    heartbeat_interval_s: float
    server_time: datetime
