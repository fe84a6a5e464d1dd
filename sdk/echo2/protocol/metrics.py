"""Per-step training metrics, as reported by the learner and served to the SDK and dashboard."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field

from .common import Model, ReadModel, RejectKind

Share = Annotated[float, Field(ge=0, le=1)]


class MismatchStats(Model):
    """How far the policy that sampled a step's tokens (their behaviour logprobs logq) is from the learner's
    (logold: its logprobs before the step, on the weights it publishes), over the step's trained tokens of
    one staleness, or of all (learner/objective.py, step 6). lw = logold - logq per token."""

    staleness: int = Field(ge=-1, le=64, description="t - x of these tokens; -1: all of the step's tokens.")
    tokens: int = Field(ge=0, le=10**10)
    kl: float = Field(ge=0, le=1e9, description="Mean k3 = exp(lw) - lw - 1: an estimate of KL(behaviour || "
                      "learner) in nats per token. At staleness 0 the train/sample mismatch alone (another "
                      "engine or precision, same weights); above it, also the drift of the steps since.")
    ess: Share = Field(description="Effective sample size of the importance weights w = exp(lw), as a share: "
                       "(sum w)^2 / (n sum w^2) over the tokens (or samples, with a sequence-level correction). "
                       "1: every weight equal.")
    clipped: Share = Field(description="Share of tokens whose weight was bounded: truncated by `tis`, or capped "
                           "by ratio_cap (correction `none`).")
    masked: Share = Field(description="Share of tokens given weight 0: by `mis` or `icepop`, or outside the "
                          "replayed sampler support.")


class StepMetrics(ReadModel):
    step: int
    t_train_s: float
    reward_mean: float | None
    reward_std: float | None
    loss: float | None
    kl: float | None
    clip_frac: float | None
    groups: int
    groups_dropped: int
    groups_rejected: int = 0
    groups_unscored: int = Field(0, description="Groups claimed for the step that its task could not score: not "
                                 "trained, back in the pool.")
    audits: int = 0
    audit_s: float = 0.0
    staleness_hist: list[int]
    mismatch: list[MismatchStats] = Field(default_factory=list, description="Behaviour against learner, per "
                                          "staleness, then the whole step (staleness -1).")
    tokens: int
    learner_utilization: float | None
    rollouts_per_s: float | None
    cost_usd: float | None
    created_at: datetime


class RolloutCounts(ReadModel):
    """A job's rollout groups by what became of them."""

    generated: int = Field(description="Groups workers submitted (each a prompt with its G samples).")
    waiting: int = Field(description="Accepted and not yet trained (queued or claimed), while the job runs.")
    unused: int = Field(0, description="Accepted and never trained because the job ended first (counted as wasted).")
    trained: int
    rejected: dict[RejectKind, int] = Field(default_factory=dict, description="Rejected groups by why.")


class EvalRead(ReadModel):
    """Held-out accuracy of one version: prompts the job never trains on, scored on the trusted side."""

    step: int = Field(description="Steps trained when it was measured (0: the base model).")
    version: int
    prompts: int
    greedy_accuracy: float | None = Field(description="Share of prompts whose greedy answer is right.")
    sampled_accuracy: float | None = Field(description="pass@1 at the job's temperature: share of prompts whose one "
                                           "sample is right.")
    sampled_reward_mean: float | None = Field(description="Mean reward of the samples (the task's reward).")
    greedy_answers: list[str] | None = Field(None, description="Each held-out prompt's greedy answer as the learner "
                                             "decoded it, in the order of GET /v1/jobs/{id}/prompts?held_out=true.")
    seconds: float
    created_at: datetime


class JobReport(ReadModel):
    """How well a job used its learner, and how much generated work went to waste."""

    job_id: str
    step: int
    learner_busy_s: float = Field(description="Seconds the job's learners spent training (every learner it had, "
                                  "before a resume or relaunch too).")
    learner_wall_s: float = Field(description="Seconds the job's learners were running, all of them together.")
    learner_idle_s: float
    learner_utilization: float | None = Field(description="busy / wall.")
    rollouts: RolloutCounts
    stale_fraction: float | None = Field(
        description="Groups rejected as stale (at submission or at claim) over groups generated: the work the "
        "staleness contract should keep near zero.")
    wasted_fraction: float | None = Field(
        description="Every group generated and not trained for a reason that is not the sender's fault (stale, "
        "after its lease ended, or still untrained when the job ended) over groups generated.")
    audits: int = 0
    audits_failed: int = 0
    audit_s: float = Field(0.0, description="Learner seconds spent auditing.")
    eval_before: EvalRead | None = Field(None, description="Held-out accuracy of the base model (step 0).")
    eval_after: EvalRead | None = Field(None, description="Held-out accuracy of the newest evaluated version.")
    mismatch: list[MismatchStats] = Field(default_factory=list, description="Behaviour against learner over "
                                          "every trained step, per staleness, then all (staleness -1): kl, "
                                          "clipped and masked are token-weighted means of the steps', ess the "
                                          "token-weighted mean of the steps' ess.")
    estimate_usd: float | None = Field(None, description="The cost estimated when the job was submitted "
                                       "(POST /v1/jobs:estimate), to compare with `cost_usd`.")
    cost_usd: float = Field(0.0, description="What the job has cost so far (learner and workers).")
