"""Rollout audits: did this group really come from the claimed model version, drawn with the seeds the
server leased it with, at the job's sampling settings?

The learner re-scores a group under the weights of the version its worker claims (learner/auditor.py
holds them) by teacher forcing, and runs three tests on every completion token y_t of every sample:

1. Replay (the one that binds a rollout to its policy). Every backend draws with echo2.sampler: token t of
   sample k is a pure function of the logits, the settings, the sample's server-assigned seed and t. The
   audit replays that draw on the recomputed logits: a token the sampler would not have chosen there, by
   more than a numerical margin, is a mismatch, and any mismatch fails the group. Samples of another
   version or a nearby model show as mismatches wherever the two models rank the top candidates
   differently; samples drawn with other seeds (picked from extra draws, or one sample copied G times),
   cut short with an end-of-sequence token, or drawn at another temperature, nearly everywhere. The margin
   covers honest numerical differences: a draw is an argmax, so an honest token's score is below the best
   by at most twice the largest logit difference between the worker's forward and this one (over T), which
   is bounded by the precision the worker computed in (`GroupClaim.precision`; calibrated by bench/audit.py,
   docs/RELIABILITY.md "Rollout audits") and narrowed to what the group's reported logprobs show of its
   worker's numerics (`AuditConfig.replay_margin`): a worker whose numbers match the audit's to 1e-6 nat gets
   no room for a stale or nearby model's near ties. The worker says what precision it computed in and reports
   its own logprobs, so both could buy room; unless worker and auditor both compute in float32, the room is
   measured instead of taken from the table: the same weights in the precision the two do not share (a
   shadow) re-score the group, and their largest difference from the audit, r, is what that precision does
   to this model on these tokens. The margin is then 8 times the smaller of r and the reported difference,
   and the supports' edges and the logprob check (2.) allow what r needs: tighter than the table where the
   model rounds little, looser where its large logits round by tenths of a nat.
2. Logprob check. The behaviour logprob a worker reports is log q_t(y_t), q_t = softmax(logits_t / T)
   over the full vocabulary before top-p (workers/echo2_worker/backends/base.py). The audit recomputes
   it; a token whose reported value is off by more than `token_tol` nats (or 4r, where a shadow measured r and
   that is more) is a bad token, and more than `max_bad_tokens` of them fail the group (invented logprobs, a
   flipped token whose logprob was left).
3. Likelihood check. Tokens sampled honestly from p~_t (q_t truncated to its top-k/top-p nucleus and
   renormalised) have E[log q_t(y_t)] = m_t = sum_y p~_t(y) log q_t(y) and variance v_t, so
       z = sum_t (log q_t(y_t) - m_t) / sqrt(sum_t v_t)
   is about N(0, 1) for an honest group; |z| > z_crit fails it. It still judges groups made before seeds
   were bound (no replay possible), and its z feeds the per-worker sequential test (api/services/evidence.py).
   A token outside the nucleus cannot be sampled at all and fails the group.

A partial rollout's tokens come from several versions (SampleSubmit.versions): `audit_versions` re-scores
and replays each token under its own version and runs the same tests over all of them.

Nothing here raises on input that passed the door's checks (ids inside the vocabulary, finite logprobs in
[-1e4, 0], at most max_new_tokens): a group that cannot be right fails instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from echo2.sampler import Ranks, RowSettings, logprobs, ranked, replay, support
from echo2.seeds import sample_seed

from .policy import pad_batch, position_ids

MIN_VARIANCE = 1e-6  # nats^2: a group of near-certain tokens has no spread to test against
# Workers compute the nucleus in their own precision (bf16 on many GPUs): a token at its edge may fall
# on either side. Only a token outside a nucleus this much wider is called impossible.
NUCLEUS_SLACK = 0.02
REPLAY_ROWS = 512  # positions replayed at once: bounds the [rows, V] tensors of a long group
# Largest logit difference (nats, at T = 1) between an honest worker's forward and the auditor's, by the
# precision the worker computed in; the replay margin is twice this over T. Measured by bench/audit.py.
LOGIT_ERROR = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.1}
# The group's own evidence narrows that: a worker's reported logprobs came from the forward it drew with, so their
# largest difference from the audit's shows how far its numbers are from the auditor's on this group. A replay gap
# from numerics is a difference of two such errors; EVIDENCE_FACTOR times the largest seen (at least MARGIN_FLOOR
# nats) bounds it with room to spare. A worker that reports noisier logprobs than it computed widens its margin
# only up to the precision's bound above or, where a shadow measured its precision's rounding on the group, up to
# EVIDENCE_FACTOR times that (`AuditConfig.replay_margin`).
EVIDENCE_FACTOR = 8.0
MARGIN_FLOOR = 1e-4
TOL_FACTOR = 4.0


@dataclass(frozen=True)
class AuditConfig:
    token_tol: float = 0.5  # nats between a reported and a recomputed logprob (more where a shadow measured more)
    max_bad_tokens: int = 0
    z_crit: float = 6.0
    logit_error: tuple[tuple[str, float], ...] = tuple(LOGIT_ERROR.items())
    auditor: str = "float32"  # the precision the audit itself computes in
    evidence_factor: float = EVIDENCE_FACTOR
    margin_floor: float = MARGIN_FLOOR

    def margin(self, precision: str, temperature: float) -> float:
        """Replay margin in nats of log q: twice the largest honest logit difference between a worker computing
        in `precision` and this auditor (the sum of both precisions' errors), over T. An unknown precision
        gets the largest."""
        errors = dict(self.logit_error)
        worst = max(errors.values())
        return 2 * (errors.get(precision, worst) + errors.get(self.auditor, worst)) / temperature

    def replay_margin(self, precision: str, temperature: float, max_abs_diff: float,
                      rounding: float | None = None) -> float:
        """The margin a replay gap is judged by: the precision's bound (`margin`), narrowed to what this group's
        reported logprobs show of its worker's numerics (`max_abs_diff`: their largest difference from the
        audit's, nats). Where a shadow re-scored the group, what the precision does on these tokens was
        measured (`rounding`: the shadow's largest difference from the audit's, nats), and that bound, not the
        table's, caps the margin: tighter on a model whose numbers round little, looser on one whose large
        logits round by tenths of a nat."""
        if (r := _measured(rounding)) is None:
            return min(self.margin(precision, temperature), self._evidence(max_abs_diff))
        return self._evidence(min(max_abs_diff, r))

    def support_slack(self, precision: str, temperature: float, rounding: float | None,
                      edge: float | None = None) -> tuple[float, float]:
        """The slacks at the edges of a top-k/top-p support (echo2.sampler.support): of top-p mass,
        NUCLEUS_SLACK, and in nats, the precision's bound; each more where a shadow measured more rounding
        (`replay_margin`; `edge`: over the tokens of the nucleus, `_nucleus_rounding`): a token's probability off
        by r nats moves a set's mass by at most e^2r - 1 of it."""
        bound = self.margin(precision, temperature)
        r, e = _measured(rounding), _measured(edge)
        mass = max((x for x in (r, e) if x is not None), default=None)
        slack_p = NUCLEUS_SLACK if mass is None else max(NUCLEUS_SLACK, min(1.0, math.expm1(2 * mass)))
        return slack_p, bound if r is None else max(bound, self._evidence(r))

    def tolerance(self, rounding: float | None) -> float:
        """Nats a reported logprob may be off: `token_tol`, or TOL_FACTOR times a shadow's measured rounding
        where that is more (an honest bf16 worker's logprobs differ from the audit's by up to 3 times the
        shadow's on SmolLM2 through vLLM: docs/RELIABILITY.md)."""
        r = _measured(rounding)
        return self.token_tol if r is None else max(self.token_tol, TOL_FACTOR * r)

    def _evidence(self, diff: float) -> float:
        return max(self.margin_floor, self.evidence_factor * diff)


def _measured(rounding: float | None) -> float | None:
    """A shadow's rounding to go by: None without a shadow or where it overflowed (not finite): the table then."""
    return rounding if rounding is not None and math.isfinite(rounding) else None


@dataclass(frozen=True)
class GroupClaim:
    """What a group claims: its prompt, samples (tokens, behaviour logprobs), the settings and seeds they were
    drawn with, and the precision its worker computed in."""

    prompt: list[int]
    samples: list[tuple[list[int], list[float]]]
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # the prompt's leased base seed; sample k drew with sample_seed(seed, k). None: no replay
    precision: str = "float32"
    masks: list[list[bool] | None] | None = None  # multi-turn: the model's tokens (the environment's are not draws)

    def seeds(self) -> list[int] | None:
        return None if self.seed is None else [sample_seed(self.seed, k) for k in range(len(self.samples))]


@dataclass(frozen=True)
class AuditResult:
    passed: bool
    reason: str | None
    tokens: int
    max_abs_diff: float
    mean_abs_diff: float
    bad_tokens: int
    z: float
    replayed: int = 0  # tokens replayed (0: the group carries no seed)
    mismatches: int = 0  # replayed tokens the sampler would not have drawn, beyond the margin
    near_ties: int = 0  # replayed tokens not drawn by the replay, but within the margin (numerics)
    max_gap: float = 0.0  # nats; the largest replay gap (capped at 1e6 for tokens outside the support)
    rounding: float | None = None  # nats; a shadow's largest difference from the audit (None: no shadow)

    def stats(self) -> dict[str, float]:
        shadow = {} if self.rounding is None else {"rounding": self.rounding}
        return {"tokens": float(self.tokens), "max_abs_diff": self.max_abs_diff,
                "mean_abs_diff": self.mean_abs_diff, "bad_tokens": float(self.bad_tokens), "z": self.z,
                "replayed": float(self.replayed), "mismatches": float(self.mismatches),
                "near_ties": float(self.near_ties), "max_gap": self.max_gap} | shadow


@dataclass(frozen=True)
class _Scores:
    picked: torch.Tensor  # [N] recomputed log q_t(y_t) of every real completion token
    reported: torch.Tensor  # [N]
    expected: torch.Tensor  # [N] m_t
    variance: torch.Tensor  # [N] v_t
    outside: int  # tokens outside their top-k/top-p nucleus
    gaps: torch.Tensor  # [M] replay gaps of the replayed tokens (M = N with seeds, else 0)
    where: torch.Tensor  # [M, 2] (sample, position) of each replayed token
    rounding: float | None = None  # the shadow's largest difference from `picked` (None: no shadow)


@torch.no_grad()
def audit_group(model: Any, claim: GroupClaim, config: AuditConfig | None = None, shadow: Any = None) -> AuditResult:
    """Re-score and replay one group (every sample answers the same prompt) under `model` and test it.
    `shadow`: the same weights in the precision that `model` and the claim do not share (`shadow_dtype`), or
    None; its difference from `model` caps the replay's margin."""
    config = config or AuditConfig()
    return _judge(_score(model, claim, claim.masks, config, shadow), config, claim)


@torch.no_grad()
def audit_versions(model_at: Callable[[int], Any], claim: GroupClaim, versions: Sequence[Sequence[int]],
                   config: AuditConfig | None = None, shadow_at: Callable[[int], Any] | None = None) -> AuditResult:
    """A partial rollout (`versions`: each sample's per-token versions): every token is re-scored and replayed
    under the version that produced it, one pass per version with the other versions' tokens masked out (they
    stay in the context the model reads), then the group is tested on all its tokens together. No token is
    skipped: the tests are sums over tokens, and each token's terms are its own version's. `shadow_at`: each
    version's shadow (`audit_group`), or None."""
    config = config or AuditConfig()
    parts = [_score(model_at(v), claim, [[x == v for x in row] for row in versions], config,
                    None if shadow_at is None else shadow_at(v))
             for v in sorted({v for row in versions for v in row})]
    roundings = [p.rounding for p in parts]  # measured on every token, or the table for the whole group
    joined = _Scores(torch.cat([p.picked for p in parts]), torch.cat([p.reported for p in parts]),
                     torch.cat([p.expected for p in parts]), torch.cat([p.variance for p in parts]),
                     sum(p.outside for p in parts), torch.cat([p.gaps for p in parts]),
                     torch.cat([p.where for p in parts]), None if None in roundings else max(roundings))
    return _judge(joined, config, claim)


def shadow_dtype(precision: str, auditor: torch.dtype) -> torch.dtype | None:
    """The precision a shadow of an auditor computing in `auditor` re-scores a group claiming `precision` in:
    the claimed one where the auditor computes in float32 and the claim is lower, float32 where the auditor
    itself is lower (its own rounding is then most of the difference), None for float32 on both sides (the
    precision's bound is already a few thousandths of a nat)."""
    if auditor != torch.float32:
        return torch.float32
    low = getattr(torch, precision, None) if precision in LOGIT_ERROR else torch.bfloat16  # unknown: the coarsest
    return None if low == torch.float32 else low


def _judge(scores: _Scores, config: AuditConfig, claim: GroupClaim) -> AuditResult:
    diff = (scores.picked - scores.reported).abs()
    rounding = scores.rounding
    tolerance = config.tolerance(rounding)
    bad = int((diff > tolerance).sum())
    spread = float(scores.variance.sum())
    z = float((scores.picked - scores.expected).sum()) / math.sqrt(max(spread, MIN_VARIANCE))
    largest = float(diff.max())
    margin = config.replay_margin(claim.precision, claim.temperature, largest, rounding)
    gaps = scores.gaps
    mismatches, near = int((gaps > margin).sum()), int(((gaps > 0) & (gaps <= margin)).sum())
    result = dict(tokens=int(diff.numel()), max_abs_diff=largest, mean_abs_diff=float(diff.mean()),
                  bad_tokens=bad, z=z, replayed=int(gaps.numel()), mismatches=mismatches, near_ties=near,
                  max_gap=min(float(gaps.max()), 1e6) if gaps.numel() else 0.0, rounding=rounding)
    if bad > config.max_bad_tokens:
        reason: str | None = (f"logprob mismatch: {bad} of {diff.numel()} tokens off by more than "
                              f"{tolerance:.3g} nat (largest {largest:.3g})")
    elif mismatches:
        sample, position = min(map(tuple, scores.where[gaps > margin].tolist()))
        reason = (f"replay: {mismatches} of {gaps.numel()} tokens are not what the sampler draws with the leased "
                  f"seeds under the claimed version (first: sample {sample}, position {position}; largest gap "
                  f"{result['max_gap']:.3g} nats, margin {margin:.3g})")
    else:
        exact = gaps.numel() == diff.numel() and not bool((gaps > 0).any())
        reason = _verdict(config, None if exact else z, scores.outside, int(diff.numel()), claim.temperature)
    return AuditResult(passed=reason is None, reason=reason, **result)  # type: ignore[arg-type]


def _verdict(config: AuditConfig, z: float | None, outside: int, tokens: int, temperature: float) -> str | None:
    """`z`: None where every token is the sampler's own draw with its leased seed (no near tie): the likelihood then
    tests nothing the replay has not settled, and at a low temperature a few lopsided terms make it far from normal
    (an honest draw of a 1e-3 token among near-certain ones gave z = -21)."""
    if outside:
        return (f"{outside} of {tokens} tokens lie outside the top-k/top-p nucleus: no sampler at these settings "
                "draws them")
    if z is not None and (not math.isfinite(z) or abs(z) > config.z_crit):
        return f"implausible tokens at temperature {temperature:g}: likelihood z = {z:.1f} (bound {config.z_crit:g})"
    return None


def _score(model: Any, claim: GroupClaim, masks: Sequence[Sequence[bool] | None] | None,
           config: AuditConfig, shadow: Any = None) -> _Scores:
    samples = claim.samples
    completions = [list(tokens) for tokens, _ in samples]
    batch = pad_batch([claim.prompt] * len(samples), completions, 0, masks).to(next(model.parameters()).device)
    targets = batch.input_ids[:, -batch.completion_len:]
    mask = batch.completion_mask.bool()
    rows, tokens = _rows(model, batch), targets[mask]  # [N, V], [N]: the real completion tokens only
    settings = _settings(claim, len(rows), rows.device)
    logq = logprobs(rows, settings)
    ranks = ranked(logq) if settings.truncates() else None  # one ranking of the vocabulary for every support
    picked = logq.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    exact = support(logq, settings, ranks=ranks)  # the nucleus the sampler draws from
    rounding = edge = None
    if shadow is not None:
        shadow_logq = logprobs(_rows(shadow, batch), settings).to(logq.device)
        rounding = float((shadow_logq.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - picked).abs().max().cpu())
        edge = _nucleus_rounding(logq, shadow_logq, exact, settings)
    slack = config.support_slack(claim.precision, claim.temperature, rounding, edge)
    possible = support(logq, settings, *slack, ranks)
    sampling = exact.softmax(-1)
    expected = torch.nan_to_num(sampling * logq).sum(-1)
    variance = torch.nan_to_num(sampling * logq.square()).sum(-1) - expected.square()
    outside = int(torch.isinf(possible.gather(-1, tokens.unsqueeze(-1))).sum())
    reported = torch.zeros_like(mask, dtype=torch.float32)
    for i, (_, lp) in enumerate(samples):
        reported[i, : len(lp)] = torch.as_tensor(lp, dtype=torch.float32)
    gaps, where = _replay(targets, mask, claim, slack, (logq, ranks, exact, possible))
    return _Scores(picked.cpu(), reported[mask].cpu(), expected.cpu(), variance.clamp(min=0).cpu(), outside, gaps,
                   where, rounding)


def _rows(model: Any, batch: Any) -> torch.Tensor:
    """[N, V] float32 logits that predict the batch's real completion tokens, by teacher forcing."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=position_ids(batch.attention_mask), logits_to_keep=batch.completion_len + 1,
                use_cache=False)
    return out.logits[:, :-1, :].float()[batch.completion_mask.bool()]  # row t predicts completion token t


def _nucleus_rounding(logq: torch.Tensor, shadow: torch.Tensor, exact: torch.Tensor, settings: RowSettings
                      ) -> float | None:
    """Where top-p truncates: the shadow's largest difference from the audit's over the tokens in either's nucleus
    (nats), which bounds how far the worker's nucleus edge moves in mass; None without top-p. The picked tokens'
    difference does not: in a flat stretch the precision re-orders many tokens of nearly the same probability."""
    if not bool((settings.top_p < 1).any()):
        return None
    either = torch.isfinite(exact) | torch.isfinite(support(shadow, settings))
    return float(torch.where(either, (shadow - logq).abs(), 0.0).max().cpu())


# The masked rows' logprobs, their ranking (None: no truncation), and their exact and widened supports.
Scored = tuple[torch.Tensor, Ranks | None, torch.Tensor, torch.Tensor]


def _replay(targets: torch.Tensor, mask: torch.Tensor, claim: GroupClaim, slack: tuple[float, float],
            scored: Scored) -> tuple[torch.Tensor, torch.Tensor]:
    """Replay gaps of the masked tokens (sample-major, position order) and their (sample, position).
    `slack`: at the supports' edges (`AuditConfig.support_slack`); `scored`: what `_score` computed of the
    masked rows (same rows, same order)."""
    seeds = claim.seeds()
    if seeds is None:
        return torch.zeros(0), torch.zeros(0, 2, dtype=torch.int64)
    device = targets.device
    sample_idx, position = mask.nonzero(as_tuple=True)
    row_seeds = torch.tensor(seeds, dtype=torch.int64, device=device)[sample_idx]
    settings = _settings(claim, len(sample_idx), device)
    gaps = []
    for start in range(0, len(sample_idx), REPLAY_ROWS):
        part = slice(start, start + REPLAY_ROWS)
        rows = sample_idx[part], position[part]
        n = len(rows[0])
        lp, ranks, exact, wide = scored[0][part], None, None, None
        if scored[1] is not None:  # truncated: its supports differ from lp (without, replay scores lp once)
            ranks, exact, wide = scored[1][part], scored[2][part], scored[3][part]
        # The replay reads the logits only to take their logprobs, which it is given: no copy of logits[rows].
        chunk = replay(lp, targets[rows], settings.select(torch.arange(start, start + n, device=device)),
                       row_seeds[part], rows[1], *slack,
                       lp=lp, ranks=ranks, exact=exact, wide=wide)
        gaps.append(chunk.gap)
    gap = torch.cat(gaps).cpu() if gaps else torch.zeros(0)
    return gap, torch.stack([sample_idx, position], -1).cpu()


def _settings(claim: GroupClaim, n: int, device: torch.device) -> RowSettings:
    """The claim's sampling settings on each of n rows."""
    one = RowSettings.of([(claim.temperature, claim.top_k, claim.top_p)], device)
    return RowSettings(one.temperature.expand(n), one.top_k.expand(n), one.top_p.expand(n))
