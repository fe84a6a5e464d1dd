"""The losses a Tinker `forward_backward` names, per datum, summed over its tokens (the SDK's `loss:sum`).

With p_t the trained model's log-probability of target token t, q_t the sampler's (`logprobs`), A_t the
per-token `advantages`, w_t the per-token `weights` (ones when absent), r_t = exp(p_t - q_t) and sg(.) a
stop-gradient (the value is used, no gradient flows through it):

- cross_entropy:        L = -sum_t w_t * p_t
- importance_sampling:  L = -sum_t r_t * A_t
- ppo:                  L = -sum_t min(r_t * A_t, clip(r_t, lo, hi) * A_t)
- cispo (MiniMax-M1, arXiv 2506.13585):
                        L = -sum_t sg(clip(r_t, lo, hi)) * A_t * p_t
  lo, hi for ppo and cispo: `clip_low_threshold` (0.8) and `clip_high_threshold` (1.2) of `loss_fn_config`.
- dro (Richemond et al. 2024, arXiv 2405.19107, in a per-token form), over the trained tokens (m_t = 1 where
  A_t != 0: an RL datum's prompt positions carry A_t = 0 and q_t = 0, and a penalty there would pull the
  prompt's logprobs towards 0):
                        L = -sum_t m_t * (p_t * A_t - beta/2 * (p_t - q_t)^2),  beta = `beta` (0.05)
- gspo (Zheng et al. 2025, arXiv 2507.18071, its GSPO-token form, one sequence per datum): over the tokens
  m_t = 1 of `sequence_ratio_mask` (default: the tokens with A_t != 0), |y| = sum_t m_t,
                        s = exp(sum_t m_t (p_t - q_t) / |y|),  s_t = sg(s) * exp(p_t - sg(p_t))  (= s in value)
                        L = -(1/|y|) sum_t m_t * min(s_t * A_t, clip(s_t, lo, hi) * A_t)
  lo, hi: `clip_low_threshold` (1 - 3e-4) and `clip_high_threshold` (1 + 4e-4), the paper's ranges.
- stable_reinforce (Echo2's own objective: Tinker has not published its): truncated importance-weighted
  REINFORCE against the *recorded* behaviour policy. b_t is the logprob the sampler recorded for the token
  (record_stability_info; the control plane looks it up through the datum's provenance spans, so the
  client's `logprobs` are not used), rho_t = exp(p_t - b_t) and C = `truncation` (2.0):
                        L = -sum_t w_t * sg(min(rho_t, C)) * A_t * p_t
  Why it is stable off policy: the weight on each token's score-function gradient A_t * grad p_t is bounded
  by C however stale the sample (importance_sampling's r_t is unbounded and its gradient grows with it), and
  it is a stop-gradient, so no gradient flows through the ratio itself; unlike ppo's clip it never zeroes
  the gradient of a token because the policy moved. b_t is the probability the token was actually drawn
  with, per token, even when an in-flight sample's tokens come from several checkpoints, so the correction
  is against the policy that produced each token and not against what a client recomputed. Its bias is
  the truncation's (tokens with rho_t > C are under-weighted, as in V-trace and truncated IS).

The ratio is taken with log r_t capped at +-LOG_RATIO_CAP: one token a sampler reported as nearly
impossible cannot make the loss infinite. No mean and no normalisation beyond the stated ones: the SDK's
losses are sums, and the caller scales by weights or advantages.
"""

from __future__ import annotations

import torch
from echo2.protocol.tinker import RECORDED_LOGPROBS, LossFn

LOG_RATIO_CAP = 20.0
CLIP = {LossFn.ppo: (0.8, 1.2), LossFn.cispo: (0.8, 1.2), LossFn.gspo: (1 - 3e-4, 1 + 4e-4)}
DRO_BETA = 0.05
TRUNCATION = 2.0
BEHAVIOUR = RECORDED_LOGPROBS  # stable_reinforce's b_t, filled in by the control plane from its records


def datum_loss(loss_fn: LossFn, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor],
               config: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one datum (a scalar) and its extra metrics, from the target tokens' log-probabilities."""
    if loss_fn is LossFn.cross_entropy:
        weights = inputs.get("weights", torch.ones_like(logprobs))
        return -(weights * logprobs).sum(), {}
    if loss_fn is LossFn.stable_reinforce:
        return _stable_reinforce(logprobs, inputs, config)
    advantages = inputs["advantages"]
    log_ratio = (logprobs - inputs["logprobs"]).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP)
    ratio = torch.exp(log_ratio)
    if loss_fn is LossFn.importance_sampling:
        return -(ratio * advantages).sum(), {}
    if loss_fn is LossFn.dro:
        beta = config.get("beta", DRO_BETA)
        trained = (advantages != 0).to(logprobs.dtype)
        penalty = 0.5 * beta * (logprobs - inputs["logprobs"]).square()
        return -(trained * (logprobs * advantages - penalty)).sum(), {}
    low, high = (config.get("clip_low_threshold", CLIP[loss_fn][0]), config.get("clip_high_threshold",
                                                                                CLIP[loss_fn][1]))
    if loss_fn is LossFn.gspo:
        return _gspo(logprobs, log_ratio, advantages, inputs.get("sequence_ratio_mask"), low, high)
    clipped = ratio.clamp(low, high)
    was_clipped = ((ratio < low) | (ratio > high)) & (advantages != 0)
    if loss_fn is LossFn.cispo:
        return -(clipped.detach() * advantages * logprobs).sum(), {"clipped:sum": float(was_clipped.sum())}
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    return -surrogate.sum(), {"clipped:sum": float(was_clipped.sum())}


def _gspo(logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor | None,
          low: float, high: float) -> tuple[torch.Tensor, dict[str, float]]:
    m = (mask if mask is not None else (advantages != 0).to(logprobs.dtype)).to(logprobs.dtype)
    length = m.sum()
    if float(length) == 0:
        return (logprobs * 0).sum(), {}
    sequence = torch.exp((m * log_ratio).sum() / length).detach()  # sg(s)
    token = sequence * torch.exp(logprobs - logprobs.detach())  # s_t: s in value, s * grad p_t in gradient
    surrogate = torch.minimum(token * advantages, token.clamp(low, high) * advantages)
    clipped = float(bool(sequence < low or sequence > high) and bool((m * advantages != 0).any()))
    return -(m * surrogate).sum() / length, {"clipped:sum": clipped}


def _stable_reinforce(logprobs: torch.Tensor, inputs: dict[str, torch.Tensor],
                      config: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
    weights = inputs.get("weights", torch.ones_like(logprobs))
    advantages = inputs["advantages"]
    rho = torch.exp((logprobs - inputs[BEHAVIOUR]).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP)).detach()
    cap = config.get("truncation", TRUNCATION)
    truncated = (rho > cap) & (advantages != 0)
    loss = -(weights * rho.clamp(max=cap) * advantages * logprobs).sum()
    return loss, {"truncated:sum": float(truncated.sum())}
