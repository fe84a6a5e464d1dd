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

2. Importance ratio and off-policy correction (`correction`).
   a. correction = "none": the ratio against the behaviour policy, capped in log space before the exponential:
       rho_{i,t} = exp(min(logp_{i,t} - logq_{i,t}, log c_{i,t})),  c_{i,t} = ratio_cap when s_{i,t} > 0, else FRESH_CAP
   (the cap bounds the update from old, off-policy samples; capped tokens carry no gradient. A fresh
   sample was generated with the weights being trained, so its ratio is 1 up to numerics; FRESH_CAP
   only bounds what a worker's forged logprobs could do: logq = -1e4 would otherwise overflow exp
   to inf and make the loss inf.) Every token has weight v_{i,t} = 1.
   b. correction = "tis" | "mis" | "icepop" (decoupled: the ratio against the learner's own policy, a
   separate weight against the behaviour). logold_{i,t} = logp_{i,t} without its gradient: the learner's
   logprob before the step, on the weights it publishes (learner/rounding.py; a model that drops out in
   training, as a LoRA adapter with `dropout` does, computes it in a pass without dropout, as it samples,
   and 2a's rho takes its value from it too: exp(logp - sg(logp) + logold - logq)); for a fresh sample that is
   the learner's recomputation of the behaviour version, so the weight below corrects exactly the
   train/sample mismatch (another engine, another precision); for a stale one it also corrects the s steps
   of drift. With H = correction_high, L = correction_low:
       rho_{i,t} = exp(logp_{i,t} - logold_{i,t})                  (1 in value; its gradient is grad logp)
       lw_{i,t}  = logold_{i,t} - logq_{i,t}                       (level "token")
       lw_{i,t}  = sum_u m_{i,u} (logold_{i,u} - logq_{i,u})         (level "sequence": the sample's, on each token)
       w = exp(lw), and the token's weight v_{i,t} (no gradient):
       tis     v = min(w, H)                                       truncated IS
       mis     v = w if w <= H else 0                              masked IS
       icepop  v = w if L <= w <= H else 0                         IcePop's two-sided mask
   With one optimiser step per batch, rho's clip in step 3 never binds (rho = 1); the weight alone bounds
   what an off-policy sample can do.
   c. Sampler-support replay (policy.py, grpo.support_replay): with top-k/top-p sampling, logp and logq are
   taken over the support S the sampler draws from, replayed on the learner's logits (echo2.sampler.support):
       logp <- logp - log Z,  logq <- logq - sg(log Z),  log Z = logsumexp_{j in S} logp(j)
   Workers report logq over the whole vocabulary; their own support's mass is taken to be the learner's
   (equal on the same weights up to numerics), so ratios keep their value and the gradient becomes the
   truncated policy's. A token outside the replayed support has v = 0 (it is "masked").

3. Per-token surrogate with two-sided clipping (PPO, asymmetric eps as in DAPO):
       u_{i,t} = min(rho_{i,t} * A_i, clip(rho_{i,t}, 1 - eps_low, 1 + eps_high) * A_i)

4. Optional KL to the reference policy, k3 estimator (unbiased, always >= 0):
       k3_{i,t} = exp(logref_{i,t} - logp_{i,t}) - (logref_{i,t} - logp_{i,t}) - 1

5. Per-token loss  l_{i,t} = -v_{i,t} * u_{i,t} + kl_coef * k3_{i,t},  reduced with length weights n and divisor D:
       loss = sum_{i,t} keep_i * m_{i,t} * n_{i,t} * l_{i,t} / D
   length_norm = "token_mean" (DAPO):  n = 1,      D = sum_{i,t} keep_i * m_{i,t}
   length_norm = "seq_mean"   (GRPO):  n = 1/L_i,  D = sum_i keep_i
   length_norm = "max_len"    (Dr.GRPO): n = 1,    D = (sum_i keep_i) * max_len   (a constant per sample)
   D is a property of the whole optimiser step: with gradient accumulation, compute it once over all
   micro-batches (`loss_denominator`) and pass it to every `grpo_loss` call so the sum of the
   micro-batch losses equals the full-batch loss.

6. Mismatch between the behaviour policy and the learner's, per staleness s (`mismatch_sums`, summed over
   micro-batches and ranks, then `mismatch_summary`), over kept completion tokens, with lw_{i,t} =
   logold_{i,t} - logq_{i,t} clamped to +-LW_CLAMP (a forged logprob must not overflow a sum):
       kl       = mean_t k3,  k3 = exp(lw) - lw - 1 >= 0: an estimate of KL(behaviour || learner)
       ess      = (sum w)^2 / (n * sum w^2) over the n tokens (level "token") or samples ("sequence")
                  of w = exp(lw): 1 when every weight is equal, 1/n when one weight carries them all
       clipped  = share of tokens whose weight was bounded: w > H under tis, the cap of step 2a under none
       masked   = share of tokens with weight 0: w outside the band under mis/icepop, or outside the
                  replayed support
   A sample's staleness for the sequence-level ess is its oldest token's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

LengthNorm = Literal["token_mean", "seq_mean", "max_len"]
CorrectionKind = Literal["none", "tis", "mis", "icepop"]
CorrectionLevel = Literal["token", "sequence"]
FRESH_CAP = 10.0  # far above any honest fresh ratio (1 +- numerics), far below float overflow
LW_CLAMP = 20.0  # |log w| in the mismatch statistics: e^40 still sums in float64
MISMATCH_SUMS = ("tokens", "k3", "clipped", "masked", "units", "w", "w2")


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
    correction: CorrectionKind = "none"
    correction_level: CorrectionLevel = "token"
    correction_low: float = 0.5
    correction_high: float = 2.0
    max_staleness: int = 0  # S: the mismatch statistics have one bucket per staleness 0..S

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
        if self.correction not in ("none", "tis", "mis", "icepop"):
            raise ValueError(f"unknown correction {self.correction!r}")
        if self.correction_level not in ("token", "sequence"):
            raise ValueError(f"unknown correction level {self.correction_level!r}")
        if not 0.0 < self.correction_low <= 1.0 <= self.correction_high:
            raise ValueError("the correction's band must hold 1: 0 < correction_low <= 1 <= correction_high")


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
    """Step 5 weights keep_i * m_{i,t} * n_{i,t}, shape [B, T]."""
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
    outside: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Steps 2-6 for a [B, T] batch of completion tokens; returns (scalar loss, stats). `staleness` is
    [B] (one per sample) or [B, T] (one per token: partial rollouts). `outside` [B, T] marks tokens outside
    the replayed sampler support (step 2c): weight 0.

    Stats are token-weighted over kept, unmasked tokens: clip_frac (the clipped branch of the min was
    taken), cap_frac (the staleness cap bound), ratio_mean, kl (mean k3, also when kl_coef = 0 if
    ref_logprobs is given), tokens (their count, for averaging over micro-batches), and the step-6 sums
    under "mismatch/<s>/<name>" (`mismatch_sums`).
    """
    if keep is None:
        keep = torch.ones(logprobs.shape[0], dtype=torch.bool, device=logprobs.device)
    if denominator is None:
        denominator = loss_denominator(completion_mask, keep, cfg)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)
    per_token = staleness if staleness.dim() == 2 else staleness.unsqueeze(-1).expand_as(logprobs)
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio, capped = _ratio(logprobs, old, behaviour_logprobs, per_token, cfg)
    weight = _Weight.of(old - behaviour_logprobs, completion_mask, cfg, outside)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv
    token_loss = -weight.value * torch.minimum(unclipped, clipped)
    kl = None
    if ref_logprobs is not None:
        log_r = ref_logprobs - logprobs
        kl = torch.exp(log_r) - log_r - 1.0
        if cfg.kl_coef > 0:
            token_loss = token_loss + cfg.kl_coef * kl
    weights = token_weights(completion_mask, keep, cfg)
    loss = (token_loss * weights).sum() / denominator
    valid = completion_mask.bool() & keep.bool().unsqueeze(-1)
    stats = _loss_stats(ratio, clipped < unclipped, capped, kl, valid)
    stats.update(mismatch_sums(weight, capped, valid, per_token, cfg))
    return loss, stats


def _ratio(logprobs: torch.Tensor, old: torch.Tensor, behaviour: torch.Tensor, staleness: torch.Tensor,
           cfg: ObjectiveConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2a or 2b's rho, and where 2a's cap bound it: its value from logold, its gradient from logprobs (the
    same but for a model that drops out in training)."""
    if cfg.correction != "none":
        return torch.exp(logprobs - logprobs.detach()), torch.zeros_like(logprobs, dtype=torch.bool)
    log_ratio = logprobs - logprobs.detach() + old - behaviour
    cap = torch.where(staleness > 0, cfg.ratio_cap, FRESH_CAP).to(log_ratio).log()
    capped = log_ratio > cap
    return torch.exp(torch.where(capped, cap, log_ratio)), capped


@dataclass(frozen=True)
class _Weight:
    """Step 2b's weight v of each token (1 under "none"), and what bounded it."""

    log_w: torch.Tensor  # lw of each token (its sample's at level "sequence"), clamped to +-LW_CLAMP
    token_log_w: torch.Tensor  # lw of each token at either level, clamped: step 6's kl
    value: torch.Tensor  # v
    clipped: torch.Tensor  # bool: truncated (tis)
    masked: torch.Tensor  # bool: weight 0 (mis, icepop, outside the support)

    @classmethod
    def of(cls, log_w: torch.Tensor, mask: torch.Tensor, cfg: ObjectiveConfig,
           outside: torch.Tensor | None) -> _Weight:
        log_w = token_log_w = log_w * mask
        if cfg.correction_level == "sequence":
            log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
        log_w, token_log_w = log_w.clamp(-LW_CLAMP, LW_CLAMP), token_log_w.clamp(-LW_CLAMP, LW_CLAMP)
        high, low = math.log(cfg.correction_high), math.log(cfg.correction_low)
        none = torch.zeros_like(log_w, dtype=torch.bool)
        clipped = log_w > high if cfg.correction == "tis" else none
        masked = {"mis": log_w > high, "icepop": (log_w > high) | (log_w < low)}.get(cfg.correction, none)
        if outside is not None:
            masked = masked | outside
        value = torch.ones_like(log_w) if cfg.correction == "none" else torch.exp(log_w.clamp(max=high))
        return cls(log_w, token_log_w, torch.where(masked, torch.zeros_like(value), value), clipped, masked)


@torch.no_grad()
def _loss_stats(ratio, clip_taken, capped, kl, valid) -> dict[str, float]:
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


def mismatch_keys(max_staleness: int) -> list[str]:
    """The names of step 6's sums, the same on every rank and micro-batch."""
    return [f"mismatch/{s}/{name}" for s in range(max_staleness + 1) for name in MISMATCH_SUMS]


@torch.no_grad()
def mismatch_sums(weight: _Weight, capped: torch.Tensor, valid: torch.Tensor, staleness: torch.Tensor,
                  cfg: ObjectiveConfig) -> dict[str, float]:
    """Step 6's sums for one micro-batch, per staleness 0..max_staleness (larger staleness: the last)."""
    lw, token_lw = weight.log_w.double(), weight.token_log_w.double()
    k3 = torch.expm1(token_lw) - token_lw  # each token's own, at level "sequence" too
    bounded = weight.clipped | capped
    stale = staleness.round().long().clamp(0, cfg.max_staleness)
    # ess units: every token, or (level "sequence") each sample once, on its first token, as stale as its oldest
    unit = valid if cfg.correction_level == "token" else _first_tokens(valid)
    unit_stale = stale if cfg.correction_level == "token" else torch.where(
        valid, stale, 0).amax(-1, keepdim=True).expand_as(stale)
    values = []
    for s in range(cfg.max_staleness + 1):
        tok, units = valid & (stale == s), unit & (unit_stale == s)
        w = lw[units].exp()
        values += [tok.sum(), k3[tok].sum(), bounded[tok].sum(), weight.masked[tok].sum(), units.sum(), w.sum(),
                   (w * w).sum()]
    # one transfer for all of them (a sync each would stall a GPU)
    return dict(zip(mismatch_keys(cfg.max_staleness), torch.stack([v.double() for v in values]).tolist(),
                    strict=True))


def _first_tokens(valid: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: each row's first valid token."""
    return valid & (valid.long().cumsum(-1) == 1)


def mismatch_summary(sums: dict[str, float], max_staleness: int) -> list[dict[str, float]]:
    """Step 6 from the summed sums: one dict per staleness that had tokens (staleness, tokens, kl, ess,
    clipped, masked), then the whole step's (staleness -1)."""
    buckets = [{name: sums.get(f"mismatch/{s}/{name}", 0.0) for name in MISMATCH_SUMS}
               for s in range(max_staleness + 1)]
    total = {name: sum(b[name] for b in buckets) for name in MISMATCH_SUMS}
    rows = [_summary(s, b) for s, b in enumerate(buckets) if b["tokens"] > 0]
    return rows + [_summary(-1, total)] if rows else []


def _summary(staleness: int, b: dict[str, float]) -> dict[str, float]:
    n = b["tokens"]
    ess = b["w"] ** 2 / (b["units"] * b["w2"]) if b["units"] and b["w2"] > 0 else 1.0
    return {"staleness": staleness, "tokens": n, "kl": max(0.0, b["k3"] / n), "ess": min(1.0, ess),
            "clipped": b["clipped"] / n, "masked": b["masked"] / n}
