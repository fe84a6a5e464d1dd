"""The learner's side of the protocol: start/resume, claim admissible rollouts, report steps, finish."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, StringConstraints

from .common import JobStatus, Model, ReadModel, ShortText, Step
from .jobs import JobRead
from .rollouts import SampleSubmit

RolloutId = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]
Reward = Annotated[float, Field(ge=-1e6, le=1e6)]


class LearnerStartReply(ReadModel):
    job: JobRead
    step: int = Field(description="Steps committed so far: resume training at this step index.")
    version: int | None = Field(description="Latest published version; the next one must be larger.")
    released: int = Field(description="Rollouts claimed but never committed, returned to the queue.")


class LearnerClaim(Model):
    step: Step = Field(description="Index t of the step being assembled (= steps already committed).")
    max_groups: int = Field(16, ge=1, le=4096)


class ClaimedGroup(ReadModel):
    rollout_id: str
    prompt_id: int
    prompt_text: str
    reference: str | None
    version: int
    worker_id: str
    prompt_token_ids: list[int]
    samples: list[SampleSubmit]


class LearnerBatch(ReadModel):
    step: int
    groups: list[ClaimedGroup]
    rejected_stale: int = Field(description="Queued rollouts found too stale for step t (prompts re-pooled).")


class RolloutRewards(Model):
    rollout_id: RolloutId
    rewards: list[Reward | None] = Field(max_length=64)


class StepReport(Model):
    step: Step
    rollout_ids: list[RolloutId] = Field(max_length=4096, description="Rollouts consumed by this step.")
    rewards: list[RolloutRewards] = Field(default_factory=list, max_length=4096)
    t_train_s: float = Field(ge=0, le=86_400)
    reward_mean: float | None = Field(None, ge=-1e6, le=1e6)
    reward_std: float | None = Field(None, ge=0, le=1e6)
    loss: float | None = Field(None, ge=-1e9, le=1e9)
    kl: float | None = Field(None, ge=-1e9, le=1e9)
    clip_frac: float | None = Field(None, ge=0, le=1)
    groups_dropped: int = Field(0, ge=0, le=4096, description="Groups whose rewards were all equal.")
    staleness_hist: list[int] = Field(default_factory=list, max_length=65, description="Index = t - x.")
    tokens: int = Field(0, ge=0, le=10**10)


class StepAck(ReadModel):
    step: int = Field(description="Steps committed after this report.")
    job_status: JobStatus
    stop: bool = Field(description="True when the learner should stop (cancelled, budget, max steps).")


class LearnerHeartbeat(Model):
    step: Step
    busy_s: float = Field(0, ge=0, le=1e9, description="Seconds spent training since the learner started.")
    wall_s: float = Field(0, ge=0, le=1e9)
    state: ShortText = "training"


class FinishOutcome(StrEnum):
    succeeded = "succeeded"
    failed = "failed"


class LearnerFinish(Model):
    outcome: FinishOutcome
    reason: ShortText | None = None
    final_version: int | None = Field(None, ge=0, description="Version holding the final checkpoint.")


class LearnerTokenIssued(ReadModel):
    job_id: str
    token: str = Field(description="Learner token for this job (shown once); earlier ones are revoked.")
