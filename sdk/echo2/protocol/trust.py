"""Audits: the learner's re-scoring of a worker's group under the version it claimed, the evidence
behind a worker's trust state (echo2.protocol.TrustState)."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from .common import ReadModel, TrustState


class AuditRead(ReadModel):
    id: int
    job_id: str
    worker_id: str
    rollout_id: str
    version: int = Field(description="The version the worker claimed its group was generated with.")
    step: int = Field(description="The learner step that audited it.")
    passed: bool
    reason: str | None = Field(None, description="Why it failed, e.g. a logprob mismatch or implausible tokens.")
    stats: dict[str, float] = Field(default_factory=dict, description="tokens, max_abs_diff, mean_abs_diff, z, ...")
    worker_trust: TrustState | None = Field(None, description="The worker's trust state now.")
    created_at: datetime
