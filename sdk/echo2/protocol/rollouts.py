"""Leases and rollouts: workers lease server-chosen prompts and submit version-tagged groups."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator

from .common import (
    Fault,
    Id,
    LeaseStatus,
    Logprob,
    Model,
    Precision,
    ReadModel,
    RejectKind,
    RolloutStatus,
    Text,
    TokenId,
    TrustState,
    Version,
)
from .fleet import SamplingParams


class LeaseRequest(Model):
    job_id: Id
    max_prompts: int = Field(8, ge=1, le=256)
    version: Version = Field(description="The weight version the worker holds and will generate with.")


class PromptSampling(ReadModel):
    """A Tinker sample request's own sampling, which its prompt's group follows instead of the lease's."""

    n: int = Field(description="Samples in the group.")
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int = Field(description="0: no top-k.")
    stop_token_ids: list[int] | None = Field(
        description="Stop at exactly these tokens (kept), and not at end-of-sequence unless listed; "
                    "null: at the model's end-of-sequence tokens; []: never before max_tokens.")


class LeasedPrompt(ReadModel):
    prompt_id: int
    text: str
    context: list[dict[str, str]] | None = Field(
        None, description="A chat item's turns before `text` ({role, content}: a system prompt, earlier turns): "
        "encode with echo2.prompting.encode_prompt(tokenizer, text, context).")
    seed: int = Field(description="Base seed; sample k uses echo2.seeds.sample_seed(seed, k).")
    token_ids: list[int] | None = Field(None, description="A Tinker prompt: generate after exactly these tokens "
                                        "(no tokenising, no chat template); `text` is empty.")
    sampling: PromptSampling | None = Field(None, description="This prompt's own sampling (a Tinker request), "
                                            "instead of the lease's.")


class EpisodeLimits(ReadModel):
    """A multi-turn job's bounds on one episode (one sample): its model turns and all its tokens."""

    max_turns: int = Field(description="Model turns at most; the environment ends the episode at the last.")
    max_tokens: int = Field(description="Tokens of all turns together, the model's and the environment's.")
    max_steps: int = Field(4_096, description="Steps one request to the episodes route may carry: what the "
                                              "environment answers within the request's deadline.")


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
    episode: EpisodeLimits | None = Field(
        None, description="Set for a multi-turn task: each sample is an episode played turn by turn through "
                          "POST /v1/leases/{id}/episodes, and submitted with its `turns`.")


class EpisodeStep(Model):
    """One model turn of an episode: sample `sample` of prompt `prompt_id`, its `turn`-th action (from 0)."""

    prompt_id: int = Field(ge=0, le=2**62)
    sample: int = Field(ge=0, le=63, description="The sample's index in its group.")
    turn: int = Field(ge=0, le=63, description="How many actions this episode had before this one; a retry "
                                              "of an answered turn gets the same answer.")
    action_token_ids: list[TokenId] = Field(min_length=1, max_length=16_384,
                                            description="The model's tokens for this turn, its stop token included.")


class EpisodeTurns(Model):
    """Model turns of a lease's episodes, played in order (one request a round, for the whole batch)."""

    steps: list[EpisodeStep] = Field(min_length=1, max_length=4_096)


class EpisodeReply(ReadModel):
    """The environment's answer: the tokens to append before the next model turn (none when done)."""

    turn: int
    done: bool
    observation_token_ids: list[int]
    observation: str = Field(description="The environment's reply as text (empty when done).")


class EpisodeReplies(ReadModel):
    replies: list[EpisodeReply] = Field(description="One per step, in the order of the request.")


MAX_VERSION_RUNS = 64  # a sample spans at most this many versions: far more than S + 1 of any job
VersionRun = tuple[Version, Annotated[int, Field(ge=1, le=16_384)]]  # (version, how many tokens in a row)


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
    turns: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, max_length=127,
        description="Multi-turn: the lengths of the token segments in order, the model's and the environment's "
                    "alternating, first and last the model's; the environment's tokens are the ones the control "
                    "plane issued, their logprobs are ignored (send 0) and they are not trained on.")
    versions: list[VersionRun] | None = Field(
        None, min_length=1, max_length=MAX_VERSION_RUNS,
        description="Partial rollouts (a job with `partial_rollouts` on): the weight version that produced each "
                    "token, as [version, count] runs oldest first, counts adding up to len(token_ids). Absent: "
                    "every token is of the group's `version`.")

    @model_validator(mode="after")
    def _aligned(self) -> SampleSubmit:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"logprobs has {len(self.logprobs)} entries but token_ids has {len(self.token_ids)}"
            )
        if self.turns is not None and (sum(self.turns) != len(self.token_ids) or len(self.turns) % 2 == 0):
            raise ValueError(f"turns must be an odd number of segment lengths (model, environment, ..., model) "
                             f"adding up to the {len(self.token_ids)} tokens; got {self.turns}")
        return self

    @model_validator(mode="after")
    def _versions_fit(self) -> SampleSubmit:
        if self.versions is None:
            return self
        if sum(n for _, n in self.versions) != len(self.token_ids):
            raise ValueError(f"versions counts add up to {sum(n for _, n in self.versions)}, but there are "
                             f"{len(self.token_ids)} tokens: give one [version, count] run per stretch of tokens")
        if any(a >= b for (a, _), (b, _) in zip(self.versions, self.versions[1:], strict=False)):
            raise ValueError(f"versions must increase from run to run (oldest first, equal runs merged); got "
                             f"{[v for v, _ in self.versions]}")
        return self

    def token_versions(self, default: int) -> list[int]:
        """The version that produced each token; `default` (the group's) when `versions` is absent."""
        if self.versions is None:
            return [default] * len(self.token_ids)
        return [v for v, n in self.versions for _ in range(n)]

    def oldest_version(self, default: int) -> int:
        return default if self.versions is None else self.versions[0][0]

    def model_token_mask(self) -> list[bool]:
        """True on the tokens the model generated (all of them for a single-turn sample)."""
        if self.turns is None:
            return [True] * len(self.token_ids)
        return [k % 2 == 0 for k, n in enumerate(self.turns) for _ in range(n)]


class GroupSubmit(Model):
    prompt_id: int = Field(ge=0, le=2**62)
    version: Version = Field(description="Weight version every sample of this group was generated with; with "
                             "partial rollouts, the version of its oldest token (it bounds the group's staleness).")
    prompt_token_ids: list[TokenId] = Field(min_length=1, max_length=32_768)
    samples: list[SampleSubmit] = Field(min_length=1, max_length=64, description="Sample k drawn with "
                                        "echo2.seeds.sample_seed(the prompt's leased seed, k), by echo2.sampler.")
    gen_seconds: float = Field(0.0, ge=0, le=86_400, description="Seconds the worker spent generating this group "
                               "(its share of a batch). The scheduler takes a worker's time a group from its "
                               "leases' times as the control plane saw them, or from these where they say longer.")
    precision: Precision = Field(Precision.float32, description="The dtype the worker computed its logits in: "
                                 "the audit's replay allows for that precision's numerical differences, as "
                                 "far as that precision's rounding moves these tokens' logprobs (measured by the "
                                 "auditor), whatever the logprobs sent.")

    @model_validator(mode="after")
    def _oldest_is_the_version(self) -> GroupSubmit:
        oldest = min(s.oldest_version(self.version) for s in self.samples)
        if oldest != self.version:
            raise ValueError(f"version is {self.version}, but the oldest token of the group is of version {oldest}: "
                             "a group's version is its oldest token's")
        return self


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
    audit: str | None = Field(None, description="`passed` or `failed` when the learner audited this group; "
                              "`pending` while a Tinker learner host audits a group drawn for a Tinker request.")
    trained_step: int | None
    completions: list[str] = Field(description="Each sample's tokens as decoded by the platform with the job's "
                                   "tokenizer (never the text a worker sent).")
    rewards: list[float | None] | None
    created_at: datetime


class TraceToken(ReadModel):
    """One completion token of a traced sample."""

    id: int
    text: str = Field(description="The token alone, decoded by the platform with the job's tokenizer.")
    version: int = Field(description="The weight version that produced it (partial rollouts: per token).")
    behaviour_logprob: float | None = Field(description="The worker's logprob of it when sampling; null for an "
                                            "environment's token (multi-turn).")
    learner_logprob: float | None = Field(description="The learner's own logprob of it when it trained the group, "
                                          "under the weights the step started from; null when not traced.")
    model: bool = Field(description="Generated by the model (false: an environment's reply, multi-turn).")


class TraceSample(ReadModel):
    index: int
    text: str = Field(description="The whole sample decoded by the platform.")
    finish_reason: str
    reward: float | None
    tokens: list[TraceToken]
    max_abs_mismatch: float | None = Field(description="The largest |behaviour - learner| logprob over its model "
                                           "tokens; null when not traced.")


class TraceWorker(ReadModel):
    id: str
    name: str | None = Field(description="Null when the worker row is gone.")
    provider_id: str | None
    trust: TrustState | None = Field(description="Its trust state now.")
    trust_reason: str | None = Field(description="The latest evidence behind its trust state, as GET "
                                     "/v1/workers/{id} shows it to you (other tenants' job and rollout ids "
                                     "replaced).")


class TraceAudit(ReadModel):
    passed: bool
    reason: str | None
    step: int
    stats: dict[str, float]


class RolloutTrace(ReadModel):
    """One rollout group as it happened, token by token: what the worker sent and the learner made of it."""

    id: str
    job_id: str
    prompt_id: int
    prompt_text: str
    prompt_tokens: int
    version: int = Field(description="The group's version (its oldest token's).")
    status: RolloutStatus
    reason: str | None
    reject_kind: RejectKind | None
    fault: Fault | None
    claim_step: int | None
    trained_step: int | None
    worker: TraceWorker
    audit: TraceAudit | None = Field(description="The learner's audit of the group, when it was audited.")
    samples: list[TraceSample]
    reward_mean: float | None
    gen_seconds: float
    cost_usd: float | None = Field(description="What the group cost: its share of the ledger entry that paid its "
                                   "worker, 0 once that payment was clawed back (null until paid, or never when "
                                   "not payable).")
    created_at: datetime
