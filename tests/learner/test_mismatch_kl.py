"""Objective.py step 6 defines the mismatch `kl` as mean_t k3 with lw_{i,t} = logold_{i,t} - logq_{i,t}
(the token's own log weight): an estimate of KL(behaviour || learner) per token. At correction_level
"sequence" mismatch_sums takes k3 of the SAMPLE's summed log weight (clamped to +-20) on every token, so the
same behaviour/learner gap reports a KL that grows exponentially with the completion length."""

from __future__ import annotations

import math

import torch

from learner.objective import ObjectiveConfig, grpo_loss, mismatch_summary


def _kl(level: str) -> float:
    cfg = ObjectiveConfig(correction="tis", correction_level=level, correction_high=1e4)
    t = 64
    logprobs = torch.zeros(2, t, requires_grad=True)  # the learner: logold = 0
    behaviour = torch.full((2, t), -0.05)  # every token: lw = +0.05
    _, stats = grpo_loss(logprobs, behaviour, torch.tensor([1.0, -1.0]), torch.ones(2, t), torch.zeros(2), cfg)
    rows = mismatch_summary({k: v for k, v in stats.items() if k.startswith("mismatch/")}, cfg.max_staleness)
    return rows[-1]["kl"]


def test_mismatch_kl_is_the_per_token_estimate_at_either_level():
    per_token = math.exp(0.05) - 0.05 - 1.0  # 0.00127 nats
    assert abs(_kl("token") - per_token) < 1e-6
    kl_seq = _kl("sequence")
    assert abs(kl_seq - per_token) < 1e-3, (
        f"same tokens, same logprobs: kl {kl_seq:.3f} at level 'sequence' vs {per_token:.5f} at level 'token'")
