"""The learner's side of the protocol: start/resume, claim admissible rollouts, report steps, finish."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, StringConstraints

from .common import JobStatus, Logprob, Model, Precision, ReadModel, ShortText, Step
from .jobs import JobRead
from .metrics import MismatchStats
from .rollouts import SampleSubmit

RolloutId = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]
REWARD_BOUND = 1e6  # a task's rewards, and so their step means, stay within ±this (tasks.base.bounded_reward)
Reward = Annotated[float, Field(ge=-REWARD_BOUND, le=REWARD_BOUND)]


class LearnerStartReply(ReadModel):
    job: JobRead
    step: int = Field(description="Steps committed so far: resume training at this step index.")
    version: int | None = Field(description="Latest published version; the next one must be larger.")
    released: int = Field(description="Rollouts claimed but never committed, returned to the queue.")
    checkpoint_step: int | None = Field(None, description="The latest learner checkpoint stored through the "
                                        "control plane: load it and replay the steps committed since.")


class LearnerClaim(Model):
    step: Step = Field(description="Index of the step being assembled: t (= steps already committed), or t + 1 "
                       "to gather the next step's rollouts while step t trains.")
    max_groups: int = Field(16, ge=1, le=4096)
    wait_s: float = Field(0.0, ge=0, le=30, description="When nothing can be claimed yet, wait up to this long for "
                          "rollouts to arrive instead of answering with none.")


class ClaimedGroup(ReadModel):
    rollout_id: str
    prompt_id: int
    prompt_text: str
    prompt_context: list[dict[str, str]] | None = Field(None, description="A chat item's turns before prompt_text "
                                                        "(LeasedPrompt.context).")
    reference: str | None
    version: int
    worker_id: str
    prompt_token_ids: list[int]
    samples: list[SampleSubmit]
    rewards: list[float | None] | None = Field(
        None, description="Multi-turn: each sample's reward, computed by the control plane's environment.")
    audit: bool = Field(False, description="Re-score this group under `version` before training on it (the "
                        "control plane picks by the sender's trust); report the outcome in the step's `audits`. A "
                        "learner may audit groups not picked too, in time it would otherwise spend waiting for "
                        "rollouts, and report them the same way.")
    seed: int | None = Field(None, description="The prompt's leased base seed: sample k was drawn with "
                             "echo2.seeds.sample_seed(seed, k), which the audit replays. None: stored before "
                             "seeds were bound to rollouts.")
    precision: Precision = Field(Precision.float32, description="The dtype its worker computed logits in.")


class ReplayStep(ReadModel):
    """A committed step as the learner trained it: its groups in order and the rewards it computed, so a
    learner resuming from an older checkpoint re-trains it to the same weights."""

    step: int
    groups: list[ClaimedGroup]
    rewards: dict[str, list[float | None]]


class LearnerBatch(ReadModel):
    step: int
    groups: list[ClaimedGroup]
    rejected_stale: int = Field(description="Queued rollouts found too stale for step t (prompts re-pooled).")


class RolloutRewards(Model):
    rollout_id: RolloutId
    rewards: list[Reward | None] = Field(max_length=64)
    learner_logprobs: list[Annotated[list[Logprob], Field(max_length=16_384)]] | None = Field(
        None, max_length=64, description="The learner's own logprob of each completion token of each sample, under "
        "the weights the step started from (rollout traces); absent when the job does not trace them.")


class RolloutRejection(Model):
    """A claimed group the learner refused to train on; always the sender's fault (its trust pays)."""

    rollout_id: RolloutId
    reason: ShortText


class AuditReport(Model):
    """The learner's re-scoring of one group under the version its sender claimed."""

    rollout_id: RolloutId
    passed: bool
    reason: ShortText | None = None
    stats: dict[Annotated[str, StringConstraints(max_length=32)], Annotated[float, Field(ge=-1e12, le=1e12)]] = \
        Field(default_factory=dict, max_length=16, description="e.g. tokens, max_abs_diff, mean_abs_diff, z.")


class AuditVerdicts(Model):
    """Audits of groups the learner claimed for `step`, sent as soon as they are made, before the step commits:
    the sender's trust moves at once, and a worker on probation, whose unjudged groups are bounded, gets more
    work once they are judged. The step's report still refuses the groups that failed."""

    step: Step
    audits: list[AuditReport] = Field(min_length=1, max_length=4096)


class AuditsRecorded(ReadModel):
    recorded: int = Field(description="Verdicts recorded now; one already recorded for its group is skipped.")


class StepReport(Model):
    step: Step
    rollout_ids: list[RolloutId] = Field(max_length=4096, description="Rollouts consumed by this step.")
    rejected: list[RolloutRejection] = Field(
        default_factory=list, max_length=4096,
        description="Claimed rollouts not trained: failed audit, poisoned loss, tokens that do not fit the model. "
        "They are rejected as the sender's fault and their prompts return to the pool.")
    unscored: list[RolloutRejection] = Field(
        default_factory=list, max_length=4096,
        description="Claimed rollouts the task could not score (its endpoint down, an exception, a timeout): not "
        "trained, never the sender's fault (it is paid as for work the platform could not use), and their prompts "
        "return to the pool. A job whose groups keep failing pauses (JobSpec.reward_failures_to_pause).")
    audits: list[AuditReport] = Field(default_factory=list, max_length=4096)
    audit_s: float = Field(0.0, ge=0, le=86_400, description="Learner seconds spent auditing in this step.")
    rewards: list[RolloutRewards] = Field(default_factory=list, max_length=4096)
    t_train_s: float = Field(ge=0, le=86_400)
    reward_mean: float | None = Field(None, ge=-REWARD_BOUND, le=REWARD_BOUND)
    reward_std: float | None = Field(None, ge=0, le=REWARD_BOUND)
    loss: float | None = Field(None, ge=-1e9, le=1e9)
    kl: float | None = Field(None, ge=-1e9, le=1e9)
    clip_frac: float | None = Field(None, ge=0, le=1)
    groups_dropped: int = Field(0, ge=0, le=4096, description="Groups trained on that taught nothing: their "
                                "rewards were all equal (zero advantage), or their loss was not finite.")
    staleness_hist: list[int] = Field(default_factory=list, max_length=65, description="Index = t - x.")
    mismatch: list[MismatchStats] = Field(default_factory=list, max_length=66, description="Behaviour policy "
                                          "against the learner's, per staleness with tokens, then all of the "
                                          "step's tokens (staleness -1).")
    tokens: int = Field(0, ge=0, le=10**10)


class StepAck(ReadModel):
    step: int = Field(description="Steps committed after this report.")
    job_status: JobStatus
    stop: bool = Field(description="True when the learner should stop: the job was cancelled, paused (budget or "
                       "quota; a new learner resumes it) or reached max_steps.")
    cost_usd: float | None = Field(None, description="What the job has cost so far (learner and workers).")


class LearnerHeartbeat(Model):
    step: Step
    busy_s: float = Field(0, ge=0, le=1e9, description="Seconds spent training since the learner started.")
    wall_s: float = Field(0, ge=0, le=1e9)
    state: ShortText = Field("training", description="What the learner is doing: `training`, `failed` (with "
                             "`error`), or while it starts `starting: ...` in words (preparing or loading the "
                             "model, the first publication and evaluation), shown as the job's status_reason.")
    error: ShortText | None = Field(None, description="Set by a learner that is about to exit on an error: the "
                                    "scheduler relaunches it at once, and fails the job after a few launches in "
                                    "a row without a committed step.")


    def starting(self) -> bool:
        return self.state.startswith("starting")


class EvalPrompt(ReadModel):
    """A held-out prompt with its reference: for the learner only (workers never see references)."""

    id: int
    text: str
    context: list[dict[str, str]] | None = None
    reference: str | None


class EvalReport(Model):
    step: Step
    version: Step
    prompts: int = Field(ge=1, le=4096)
    greedy_accuracy: float | None = Field(None, ge=0, le=1)
    sampled_accuracy: float | None = Field(None, ge=0, le=1)
    sampled_reward_mean: float | None = Field(None, ge=-REWARD_BOUND, le=REWARD_BOUND)
    seconds: float = Field(ge=0, le=86_400)
    greedy_answers: list[Annotated[str, StringConstraints(max_length=4096)]] | None = Field(
        None, max_length=4096, description="Each held-out prompt's greedy answer, in the order of the prompts "
        "(GET /v1/jobs/{id}/prompts?held_out=true).")


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
