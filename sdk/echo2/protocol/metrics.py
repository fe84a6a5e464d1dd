"""Per-step training metrics, as reported by the learner and served to the SDK and dashboard."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from .common import ReadModel, RejectKind


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
    tokens: int
    learner_utilization: float | None
    rollouts_per_s: float | None
    cost_usd: float | None
    created_at: datetime


class RolloutCounts(ReadModel):
    """A job's rollout groups by what became of them."""

    generated: int = Field(description="Groups workers submitted (each a prompt with its G samples).")
    waiting: int = Field(description="Accepted and not yet trained (queued or claimed).")
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
    learner_busy_s: float = Field(description="Seconds the current learner spent training (since it started).")
    learner_wall_s: float = Field(description="Seconds since the current learner started.")
    learner_idle_s: float
    learner_utilization: float | None = Field(description="busy / wall.")
    rollouts: RolloutCounts
    stale_fraction: float | None = Field(
        description="Groups rejected as stale (at submission or at claim) over groups generated: the work the "
        "staleness contract should keep near zero.")
    wasted_fraction: float | None = Field(
        description="Every group generated and not trained for a reason that is not the sender's fault (stale, "
        "or after its lease ended) over groups generated.")
    audits: int = 0
    audits_failed: int = 0
    audit_s: float = Field(0.0, description="Learner seconds spent auditing.")
    eval_before: EvalRead | None = Field(None, description="Held-out accuracy of the base model (step 0).")
    eval_after: EvalRead | None = Field(None, description="Held-out accuracy of the newest evaluated version.")
    estimate_usd: float | None = Field(None, description="The cost estimated when the job was submitted "
                                       "(POST /v1/jobs:estimate), to compare with `cost_usd`.")
    cost_usd: float = Field(0.0, description="What the job has cost so far (learner and workers).")
