"""The GRPO objective of the Echo2 learner, with bounded-staleness importance weighting.

Notation. A batch holds groups of completions; group g answers one prompt and has rewards r_1..r_G.
Sample i has completion tokens t = 1..L_i, a mask m_{i,t} (1 for a real completion token, 0 for
padding), staleness s_{i,t} = (learner step) - (policy version that generated token t: the same for
every token of a sample, except with partial rollouts, where a sample's later tokens may come from
newer versions), and per-token logprobs
of the sampled token under three policies, all computed as log softmax(logits / temperature):
    logp_{i,t}      current policy (the one being trained; gradients flow through it only),
    logq_{i,t}      behaviour policy (reported by the worker that sampled it, under the version that drew it),
    logref_{i,t}    reference policy (optional, usually the initial model).

1. Advantages (per group, shared by every token of a sample):
       A_i = r_i - mean_g(r)                      (scale_by_std=False: Dr.GRPO, no std division)
       A_i = (r_i - mean_g(r)) / (std_g(r) + eps) (scale_by_std=True: original GRPO; population std)
   A group whose rewards are all equal carries no signal (all A_i = 0); it is dropped: its samples
   get keep_i = 0 and count neither in the loss nor in its normaliser.

2. Importance ratio against the behaviour policy, capped in log space before the exponential:
       rho_{i,t} = exp(min(logp_{i,t} - logq_{i,t}, log c_{i,t})),  c_{i,t} = ratio_cap when s_{i,t} > 0, else FRESH_CAP
   (the cap bounds the update from old, off-policy samples; capped tokens carry no gradient. A fresh
   sample was generated with the weights being trained, so its ratio is 1 up to numerics; FRESH_CAP
   only bounds what a worker's forged logprobs could do: logq = -1e4 would otherwise overflow exp
   to inf and make the loss inf.)

3. Per-token surrogate with two-sided clipping (PPO, asymmetric eps as in DAPO):
       u_{i,t} = min(rho_{i,t} * A_i, clip(rho_{i,t}, 1 - eps_low, 1 + eps_high) * A_i)

4. Optional KL to the reference policy, k3 estimator (unbiased, always >= 0):
       k3_{i,t} = exp(logref_{i,t} - logp_{i,t}) - (logref_{i,t} - logp_{i,t}) - 1

5. Per-token loss  l_{i,t} = -u_{i,t} + kl_coef * k3_{i,t},  reduced with weights w and divisor D:
       loss = sum_{i,t} keep_i * m_{i,t} * w_{i,t} * l_{i,t} / D
   length_norm = "token_mean" (DAPO):  w = 1,      D = sum_{i,t} keep_i * m_{i,t}
   length_norm = "seq_mean"   (GRPO):  w = 1/L_i,  D = sum_i keep_i
   length_norm = "max_len"    (Dr.GRPO): w = 1,    D = (sum_i keep_i) * max_len   (a constant per sample)
   D is a property of the whole optimiser step: with gradient accumulation, compute it once over all
   micro-batches (`loss_denominator`) and pass it to every `grpo_loss` call so the sum of the
   micro-batch losses equals the full-batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LengthNorm = Literal["token_mean", "seq_mean", "max_len"]
FRESH_CAP = 10.0  # far above any honest fresh ratio (1 +- numerics), far below float overflow


@dataclass(frozen=True)
class ObjectiveConfig:
    eps_low: float = 0.2
    eps_high: float = 0.28
    ratio_cap: float = 2.0
    kl_coef: float = 0.0
    length_norm: LengthNorm = "token_mean"
    max_len: int | None = None  # required by length_norm="max_len"
    scale_by_std: bool = True
    std_eps: float = 1e-6

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_low < 1.0 or self.eps_high < 0.0:
            raise ValueError("eps_low must be in [0, 1) and eps_high >= 0")
        if self.ratio_cap < 1.0:
            raise ValueError("ratio_cap must be >= 1")
        if self.kl_coef < 0.0:
            raise ValueError("kl_coef must be >= 0")
        if self.length_norm not in ("token_mean", "seq_mean", "max_len"):
            raise ValueError(f"unknown length_norm {self.length_norm!r}")
        if self.length_norm == "max_len" and not (self.max_len and self.max_len > 0):
            raise ValueError('length_norm="max_len" needs a positive max_len')


@dataclass(frozen=True)
class Advantages:
    advantages: torch.Tensor  # [N] float, 0 for dropped samples
    keep: torch.Tensor  # [N] bool, False for samples of dropped groups
    dropped_groups: list[int]  # group ids whose rewards were all equal

    @property
    def num_dropped(self) -> int:
        return len(self.dropped_groups)


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> Advantages:
    """Step 1: group-normalised advantages; groups with all-equal rewards are dropped."""
    rewards = rewards.to(torch.float64)
    advantages = torch.zeros_like(rewards)
    keep = torch.zeros(rewards.shape, dtype=torch.bool)
    dropped: list[int] = []
    for gid in torch.unique(group_ids).tolist():
        members = group_ids == gid
        r = rewards[members]
        if bool((r == r[0]).all()):
            dropped.append(int(gid))
            continue
        centred = r - r.mean()
        if scale_by_std:
            centred = centred / (r.std(unbiased=False) + eps)
        advantages[members] = centred
        keep[members] = True
    return Advantages(advantages.to(torch.float32), keep, dropped)


def token_weights(completion_mask: torch.Tensor, keep: torch.Tensor, cfg: ObjectiveConfig) -> torch.Tensor:
    """Step 5 weights keep_i * m_{i,t} * w_{i,t}, shape [B, T]."""
    mask = completion_mask.to(torch.float32) * keep.to(torch.float32).unsqueeze(-1)
    if cfg.length_norm == "seq_mean":
        lengths = completion_mask.to(torch.float32).sum(-1, keepdim=True).clamp(min=1.0)
        mask = mask / lengths
    return mask


def loss_denominator(completion_mask: torch.Tensor, keep: torch.Tensor, cfg: ObjectiveConfig) -> float:
    """Step 5 divisor D over a whole optimiser step (all micro-batches); at least 1."""
    kept = keep.to(torch.float32)
    if cfg.length_norm == "token_mean":
        d = float((completion_mask.to(torch.float32) * kept.unsqueeze(-1)).sum())
    elif cfg.length_norm == "seq_mean":
        d = float(kept.sum())
    else:
        d = float(kept.sum()) * float(cfg.max_len or 1)
    return max(d, 1.0)


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    staleness: torch.Tensor,
    cfg: ObjectiveConfig,
    *,
    keep: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Steps 2-5 for a [B, T] batch of completion tokens; returns (scalar loss, stats). `staleness` is
    [B] (one per sample) or [B, T] (one per token: partial rollouts).

    Stats are token-weighted over kept, unmasked tokens: clip_frac (the clipped branch of the min was
    taken), cap_frac (the staleness cap bound), ratio_mean, kl (mean k3, also when kl_coef = 0 if
    ref_logprobs is given), and tokens (their count, for averaging over micro-batches).
    """
    if keep is None:
        keep = torch.ones(logprobs.shape[0], dtype=torch.bool, device=logprobs.device)
    if denominator is None:
        denominator = loss_denominator(completion_mask, keep, cfg)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)
    log_ratio = logprobs - behaviour_logprobs
    per_token = staleness if staleness.dim() == 2 else staleness.unsqueeze(-1)
    cap = torch.where(per_token > 0, cfg.ratio_cap, FRESH_CAP).to(log_ratio).log()
    capped = log_ratio > cap
    ratio = torch.exp(torch.where(capped, cap.expand_as(log_ratio), log_ratio))
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    per_token = -surrogate
    kl = None
    if ref_logprobs is not None:
        log_r = ref_logprobs - logprobs
        kl = torch.exp(log_r) - log_r - 1.0
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
    weights = token_weights(completion_mask, keep, cfg)
    loss = (per_token * weights).sum() / denominator
    return loss, _loss_stats(ratio, clipped < unclipped, capped, kl, completion_mask, keep)


@torch.no_grad()
def _loss_stats(ratio, clip_taken, capped, kl, completion_mask, keep) -> dict[str, float]:
    valid = completion_mask.bool() & keep.bool().unsqueeze(-1)
    n = int(valid.sum())
    if n == 0:
        return {"tokens": 0.0, "clip_frac": 0.0, "cap_frac": 0.0, "ratio_mean": 1.0, "kl": 0.0}
    return {
        "tokens": float(n),
        "clip_frac": float(clip_taken[valid].float().mean()),
        "cap_frac": float(capped[valid].float().mean()),
        "ratio_mean": float(ratio[valid].mean()),
        "kl": float(kl[valid].mean()) if kl is not None else 0.0,
    }
