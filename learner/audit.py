"""Rollout audits: did this group really come from the claimed model version, at the job's temperature?

The learner re-scores a group under the weights of the version its worker claims (learner/auditor.py
holds them) and runs two tests on every completion token y_t of every sample:

1. Logprob check. The behaviour logprob a worker reports is log q_t(y_t), q_t = softmax(logits_t / T)
   over the full vocabulary before top-p (workers/echo2_worker/backends/base.py). The audit recomputes
   it; a token whose reported value is off by more than `token_tol` nats is a bad token, and more than
   `max_bad_tokens` of them fail the group. Catches invented logprobs, a flipped token whose logprob
   was left alone, another model's or another temperature's logprobs.
2. Likelihood check. Tokens sampled honestly from p~_t (q_t truncated to its top-k/top-p nucleus and
   renormalised) have E[log q_t(y_t)] = m_t = sum_y p~_t(y) log q_t(y) and variance v_t, so
       z = sum_t (log q_t(y_t) - m_t) / sqrt(sum_t v_t)
   is a sum of martingale differences, about N(0, 1) for an honest group. |z| > z_crit fails it.
   Catches tokens that are implausible under the claimed model even when their logprobs were
   recomputed to match: random tokens, another model's, sampling too hot (z << 0) or too cold or
   cherry-picked (z >> 0). A token outside the nucleus cannot be sampled at all and fails the group.

A partial rollout's tokens come from several versions (SampleSubmit.versions): `audit_versions` re-scores
each token under its own version and runs the same two tests over all of them.

Tolerances (AuditConfig defaults) and how they were chosen are in docs/RELIABILITY.md ("Rollout
audits"), measured with bench/audit.py on honest groups from both backends.
Nothing here raises on input that passed the door's checks (ids inside the vocabulary, finite
logprobs in [-1e4, 0], at most max_new_tokens): a group that cannot be right fails instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .policy import pad_batch, position_ids

MIN_VARIANCE = 1e-6  # nats^2: a group of near-certain tokens has no spread to test against
# Workers compute the nucleus in their own precision (bf16 on many GPUs): a token at its edge may fall
# on either side. Only a token outside a nucleus this much wider is called impossible.
NUCLEUS_SLACK = 0.02


@dataclass(frozen=True)
class AuditConfig:
    token_tol: float = 0.5  # nats between a reported and a recomputed logprob
    max_bad_tokens: int = 0
    z_crit: float = 6.0


@dataclass(frozen=True)
class AuditResult:
    passed: bool
    reason: str | None
    tokens: int
    max_abs_diff: float
    mean_abs_diff: float
    bad_tokens: int
    z: float

    def stats(self) -> dict[str, float]:
        return {"tokens": float(self.tokens), "max_abs_diff": self.max_abs_diff,
                "mean_abs_diff": self.mean_abs_diff, "bad_tokens": float(self.bad_tokens), "z": self.z}


@dataclass(frozen=True)
class _Scores:
    picked: torch.Tensor  # [N] recomputed log q_t(y_t) of every real completion token
    reported: torch.Tensor  # [N]
    expected: torch.Tensor  # [N] m_t
    variance: torch.Tensor  # [N] v_t
    outside: int  # tokens outside their top-k/top-p nucleus


@torch.no_grad()
def audit_group(model: Any, prompt_token_ids: list[int], samples: Sequence[tuple[list[int], list[float]]], *,
                temperature: float, top_p: float, pad_id: int, config: AuditConfig | None = None,
                top_k: int = 0, masks: Sequence[Sequence[bool] | None] | None = None) -> AuditResult:
    """Re-score one group (every sample answers the same prompt) under `model` and test it. `masks`:
    a multi-turn sample's model tokens; the environment's tokens in between are not the model's draws."""
    scores = _score(model, prompt_token_ids, samples, temperature, top_p, top_k, pad_id, masks)
    return _judge(scores, config or AuditConfig(), temperature)


@torch.no_grad()
def audit_versions(model_at: Callable[[int], Any], prompt_token_ids: list[int],
                   samples: Sequence[tuple[list[int], list[float]]], versions: Sequence[Sequence[int]], *,
                   temperature: float, top_p: float, pad_id: int, config: AuditConfig | None = None,
                   top_k: int = 0) -> AuditResult:
    """A partial rollout (`versions`: each sample's per-token versions): every token is re-scored under
    the version that produced it, one pass per version with the other versions' tokens masked out (they
    stay in the context the model reads), then the group is tested on all its tokens together. No token
    is skipped: the tests are sums over tokens, and each token's terms are its own version's."""
    parts = [_score(model_at(v), prompt_token_ids, samples, temperature, top_p, top_k, pad_id,
                    [[x == v for x in row] for row in versions])
             for v in sorted({v for row in versions for v in row})]
    joined = _Scores(torch.cat([p.picked for p in parts]), torch.cat([p.reported for p in parts]),
                     torch.cat([p.expected for p in parts]), torch.cat([p.variance for p in parts]),
                     sum(p.outside for p in parts))
    return _judge(joined, config or AuditConfig(), temperature)


def _judge(scores: _Scores, config: AuditConfig, temperature: float) -> AuditResult:
    diff = (scores.picked - scores.reported).abs()
    bad = int((diff > config.token_tol).sum())
    spread = float(scores.variance.sum())
    z = float((scores.picked - scores.expected).sum()) / math.sqrt(max(spread, MIN_VARIANCE))
    result = dict(tokens=int(diff.numel()), max_abs_diff=float(diff.max()), mean_abs_diff=float(diff.mean()),
                  bad_tokens=bad, z=z)
    reason = _verdict(config, bad, int(diff.numel()), float(diff.max()), z, scores.outside, temperature)
    return AuditResult(passed=reason is None, reason=reason, **result)


def _verdict(config: AuditConfig, bad: int, tokens: int, worst: float, z: float, outside: int,
             temperature: float) -> str | None:
    if bad > config.max_bad_tokens:
        return (f"logprob mismatch: {bad} of {tokens} tokens off by more than {config.token_tol:g} nat "
                f"(largest {worst:.3g})")
    if outside:
        return (f"{outside} of {tokens} tokens lie outside the top-k/top-p nucleus: no sampler at these settings "
                "draws them")
    if not math.isfinite(z) or abs(z) > config.z_crit:
        return f"implausible tokens at temperature {temperature:g}: likelihood z = {z:.1f} (bound {config.z_crit:g})"
    return None


def _score(model: Any, prompt: list[int], samples: Sequence[tuple[list[int], list[float]]], temperature: float,
           top_p: float, top_k: int, pad_id: int, masks: Sequence[Sequence[bool] | None] | None = None) -> _Scores:
    completions = [list(tokens) for tokens, _ in samples]
    batch = pad_batch([prompt] * len(samples), completions, pad_id, masks).to(next(model.parameters()).device)
    c = batch.completion_len
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=position_ids(batch.attention_mask), logits_to_keep=c + 1, use_cache=False)
    logq = torch.log_softmax(out.logits[:, :-1, :].float() / temperature, dim=-1)  # [B, C, V]
    targets = batch.input_ids[:, -c:]
    mask = batch.completion_mask.bool()
    picked = logq.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    sampling, possible = _nuclei(logq.exp(), (top_p, min(1.0, top_p + NUCLEUS_SLACK)), top_k)
    expected = (sampling * logq).sum(-1)
    variance = (sampling * logq.square()).sum(-1) - expected.square()
    outside = int(((possible.gather(-1, targets.unsqueeze(-1)).squeeze(-1) <= 0) & mask).sum())
    reported = torch.zeros_like(picked)
    for i, (_, logprobs) in enumerate(samples):
        reported[i, : len(logprobs)] = torch.as_tensor(logprobs, dtype=torch.float32)
    return _Scores(picked[mask].cpu(), reported[mask].cpu(), expected[mask].cpu(), variance[mask].clamp(min=0).cpu(),
                   outside)


def _nuclei(probs: torch.Tensor, top_ps: tuple[float, ...], top_k: int = 0) -> list[torch.Tensor]:
    """For each top_p, the distribution a top-k/top-p sampler draws from: the k most likely tokens,
    then the smallest prefix of them whose mass reaches top_p of theirs, renormalised — the same rule
    as the workers' samplers (and vLLM's). One sort serves them all (it is most of an audit's cost)."""
    if top_k <= 0 and all(p >= 1.0 for p in top_ps):
        return [probs] * len(top_ps)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    if top_k > 0:
        sorted_p[..., top_k:] = 0.0
    before = sorted_p.cumsum(-1) - sorted_p
    total = sorted_p.sum(-1, keepdim=True)
    out = []
    for top_p in top_ps:
        kept = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(before >= top_p * total, 0.0))
        out.append(kept / kept.sum(-1, keepdim=True))
    return out
