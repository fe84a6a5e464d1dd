"""The losses a Tinker `forward_backward` names, per datum, summed over its tokens (the SDK's `loss:sum`).

With p the trained model's log-probability of each target token, q the sampler's (`logprobs`), A the
per-token `advantages` and w the per-token `weights` (ones when absent):

- cross_entropy:        L = -sum_t w_t * p_t
- importance_sampling:  L = -sum_t r_t * A_t,  r_t = exp(p_t - q_t)
- ppo:                  L = -sum_t min(r_t * A_t, clip(r_t, lo, hi) * A_t),  lo, hi = `clip_low_threshold`
                        (0.8) and `clip_high_threshold` (1.2) of `loss_fn_config`

The ratio is taken with log r_t capped at +-LOG_RATIO_CAP: one token a sampler reported as nearly
impossible cannot make the loss infinite. No mean and no normalisation: the SDK's losses are sums, and
the caller scales by weights or advantages.
"""

from __future__ import annotations

import torch
from echo2.protocol.tinker import LossFn

LOG_RATIO_CAP = 20.0


def datum_loss(loss_fn: LossFn, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor],
               config: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one datum (a scalar) and its extra metrics, from the target tokens' log-probabilities."""
    if loss_fn is LossFn.cross_entropy:
        weights = inputs.get("weights", torch.ones_like(logprobs))
        return -(weights * logprobs).sum(), {}
    ratio = torch.exp((logprobs - inputs["logprobs"]).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP))
    advantages = inputs["advantages"]
    if loss_fn is LossFn.importance_sampling:
        return -(ratio * advantages).sum(), {}
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    clipped = ratio.clamp(low, high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    was_clipped = ((ratio < low) | (ratio > high)) & (advantages != 0)
    return -surrogate.sum(), {"clipped:sum": float(was_clipped.sum())}
