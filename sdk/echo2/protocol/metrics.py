"""Per-step training metrics, as reported by the learner and served to the SDK and dashboard."""

from __future__ import annotations

from datetime import datetime

from .common import ReadModel


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
    audits: int = 0
    audit_s: float = 0.0
    staleness_hist: list[int]
    tokens: int
    learner_utilization: float | None
    rollouts_per_s: float | None
    cost_usd: float | None
    created_at: datetime
