"""Leases and rollouts: workers lease server-chosen prompts and submit version-tagged groups."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator

from .common import Fault, Id, LeaseStatus, Logprob, Model, ReadModel, RejectKind, RolloutStatus, Text, TokenId, Version
from .fleet import SamplingParams


class LeaseRequest(Model):
    job_id: Id
    max_prompts: int = Field(8, ge=1, le=256)
    version: Version = Field(description="The weight version the worker holds and will generate with.")


class LeasedPrompt(ReadModel):
    prompt_id: int
    text: str
    seed: int = Field(description="Base seed; sample k uses echo2.seeds.sample_seed(seed, k).")


class LeaseRead(ReadModel):
    id: str
    job_id: str
    worker_id: str
    status: LeaseStatus
    version: int
    prompts: list[LeasedPrompt]
    sampling: SamplingParams
    expires_at: datetime
    created_at: datetime


class FinishReason(StrEnum):
    stop = "stop"
    length = "length"


class SampleSubmit(Model):
    """One sample. The control plane checks it against the job at the door: at most the job's
    `max_new_tokens` tokens, every id inside the vocabulary, logprobs finite and no lower than a
    token an honest sampler could have drawn, and `finish_reason` consistent with the tokens."""

    token_ids: list[TokenId] = Field(min_length=1, max_length=16_384, description="Completion tokens only.")
    logprobs: list[Logprob] = Field(max_length=16_384, description="Behaviour log-probs, one per token.")
    text: Text = Field("", description="Ignored: the platform decodes the tokens itself and shows only that text.")
    finish_reason: FinishReason

    @model_validator(mode="after")
    def _aligned(self) -> SampleSubmit:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"logprobs has {len(self.logprobs)} entries but token_ids has {len(self.token_ids)}"
            )
        return self


class GroupSubmit(Model):
    prompt_id: int = Field(ge=0, le=2**62)
    version: Version = Field(description="Weight version every sample of this group was generated with.")
    prompt_token_ids: list[TokenId] = Field(min_length=1, max_length=32_768)
    samples: list[SampleSubmit] = Field(min_length=1, max_length=64)
    gen_seconds: float = Field(0.0, ge=0, le=86_400)


class RolloutSubmit(Model):
    groups: Annotated[list[GroupSubmit], Field(min_length=1, max_length=256)]


class GroupResult(ReadModel):
    prompt_id: int
    rollout_id: str | None
    status: RolloutStatus
    reason: str | None = None


class RolloutSubmitResult(ReadModel):
    results: list[GroupResult]


class RolloutRead(ReadModel):
    id: str
    job_id: str
    prompt_id: int
    prompt_text: str
    worker_id: str
    lease_id: str
    version: int
    status: RolloutStatus
    reason: str | None
    reject_kind: RejectKind | None = Field(None, description="Why it was rejected, as a code.")
    fault: Fault | None = Field(None, description="Whose fault a rejection is (worker, late, platform).")
    audit: str | None = Field(None, description="`passed` or `failed` when the learner audited this group.")
    trained_step: int | None
    completions: list[str] = Field(description="Each sample's tokens as decoded by the platform with the job's "
                                   "tokenizer (never the text a worker sent).")
    rewards: list[float | None] | None
    created_at: datetime
