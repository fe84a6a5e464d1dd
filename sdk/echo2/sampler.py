"""The replayable sampler: every sampled token is a pure function of (the logits, the sampling settings, the
sample's server-assigned seed, the token's position), so whoever holds the weights can replay a rollout.

Every backend draws with it (the worker's transformers and vLLM backends, the Tinker host, the learner's
evaluation), and the learner's auditor replays it (learner/audit.py): a rollout made by other weights, or
with other seeds, or picked, duplicated or cut short, shows as tokens the replay does not choose.

The draw, for one row (one sample at one position p, seed s, temperature T, top-k k, top-p q):
1. lp = log_softmax(logits / T) over the whole vocabulary: the behaviour logprob reported for the drawn
   token (base.py of the worker's backends), unchanged by truncation.
2. The support: the k most likely tokens (k = 0: all), then the smallest prefix of them, most likely first,
   whose mass reaches q of theirs (the rule vLLM applies; their mass is the cumulative sum's last value, or
   without top-k the sum of every probability). Tokens outside it get lp = -inf; a row with k = 0 and q = 1
   keeps every token.
3. Two-stage Gumbel-max over blocks of BLOCK consecutive token ids. Each block's log-mass
   L_b = logsumexp(lp over the block's supported tokens); the block drawn is argmax_b (L_b + G(s, p, BLOCK_SALT, b)),
   then the token drawn is argmax over that block's tokens i of (lp_i + G(s, p, TOKEN_SALT, i)).
   G(...) = -log(-log(u)), u = ((h >> 9) + 1/2) / 2^23 with h a 32-bit hash (`_hash32`) of the four values.
   Gumbel-max draws a block with probability ∝ its mass and, within it, a token ∝ its probability: exactly
   the categorical distribution of step 2. The blocks keep it cheap: 2·BLOCK noise values per draw instead of
   one per vocabulary entry (49,152 for SmolLM2), which on a CPU cost more than the draw itself.
Greedy (T = 0, held-out evaluation only): the argmax of the logits, reported under T = 1.

Why this replays across machines: the noise is integer arithmetic (exact everywhere), and a draw is an
argmax, so numerical differences in the logits (another device, dtype, batch shape or engine) change the
choice only where two candidates are within those differences of each other. `replay_gaps` reports, per
token, how far the claimed token's score is below the best one the replay finds; an honest token's gap is
at most twice the largest logit error between the two machines (over T), a cheat's is not bounded by it.

The hash: the 32-bit `lowbias32` finaliser (Wellons, hash-prospector) with its second multiplier's top bit
cleared, so every product of int64 tensors stays below 2^63 on every device (no overflow, no undefined
behaviour); a top bit only flips bit 31 of a product, which the final xor-shift spreads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 256  # token ids per block of the two-stage draw; part of the sampler's definition, like the salts
_MASK = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x046CA68B
_GOLDEN = 0x9E3779B1  # spreads consecutive indices over the 32-bit space before they are hashed
BLOCK_SALT, TOKEN_SALT = 0x0B10C4ED, 0x70CE4A11
_NEG_INF = float("-inf")


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def hash32(value: int) -> int:
    """The same hash on one Python int (the reference the tensors are tested against)."""
    x = value & _MASK
    x ^= x >> 16
    x = (x * _M1) & _MASK
    x ^= x >> 15
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """[R] int64 keys of (seed, position, salt): the stream each row's noise is drawn from."""
    x = _hash32((seeds.to(torch.int64) & _MASK) ^ salt)
    x = _hash32(x ^ ((positions.to(torch.int64) * _GOLDEN) & _MASK))
    return x


def gumbel(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gumbel noise G(key, i) for each row's key [R] and indices [R, n] (or [n]), float32 [R, n]."""
    h = _hash32(keys.unsqueeze(-1) ^ ((index.to(torch.int64) * _GOLDEN) & _MASK))
    u = ((h >> 9).to(torch.float32) + 0.5) * (2.0**-23)  # 23 bits: u + 1/2 ulp stays below 1 in float32
    return -torch.log(-torch.log(u))


@dataclass(frozen=True)
class RowSettings:
    """Each row's sampling settings, [R] tensors on the logits' device."""

    temperature: torch.Tensor  # float32; 0 = greedy
    top_k: torch.Tensor  # int64; 0 = no top-k
    top_p: torch.Tensor  # float32 in (0, 1]
    # Whether any row truncates / is greedy, when known without reading the tensors back: on a GPU each
    # read is a device sync, and a decode loop would pay two per token.
    any_truncation: bool | None = None
    any_greedy: bool | None = None

    @classmethod
    def of(cls, rows: list[tuple[float, int, float]], device: torch.device | str) -> RowSettings:
        """From (temperature, top_k, top_p) per row."""
        return cls(torch.tensor([r[0] for r in rows], dtype=torch.float32, device=device),
                   torch.tensor([r[1] for r in rows], dtype=torch.int64, device=device),
                   torch.tensor([r[2] for r in rows], dtype=torch.float32, device=device),
                   any_truncation=any(r[1] > 0 or r[2] < 1 for r in rows), any_greedy=any(r[0] <= 0 for r in rows))

    def select(self, rows: torch.Tensor) -> RowSettings:
        return RowSettings(self.temperature[rows], self.top_k[rows], self.top_p[rows])

    def truncates(self) -> bool:
        if self.any_truncation is not None:
            return self.any_truncation
        return bool(((self.top_k > 0) | (self.top_p < 1)).any())

    def has_greedy(self) -> bool:
        if self.any_greedy is not None:
            return self.any_greedy
        return bool((self.temperature <= 0).any())


def logprobs(logits: torch.Tensor, settings: RowSettings) -> torch.Tensor:
    """log_softmax(logits / T) in float32, [R, V]; greedy rows (T = 0) at T = 1."""
    scale = torch.where(settings.temperature > 0, settings.temperature, torch.ones_like(settings.temperature))
    return torch.log_softmax(logits.float() / scale.unsqueeze(-1), dim=-1)


PREFIX = 1024  # tokens a CPU ranks first (a partial sort); a support reaching past them ranks the whole vocabulary


class Ranks:
    """Each row's most likely tokens, most likely first (`top`: their probabilities, `order`: their ids), every
    token's probability `p` and its sum `total`: what `support` truncates by. Sorting the vocabulary is most of an
    audit's cost on a CPU, so there only the first PREFIX are ranked, and `full()` ranks the rest once, for a
    support that reaches past them; on another device (a sort is cheap there, and a check of whether the prefix
    suffices would be a device sync per decoded token) every token is ranked."""

    __slots__ = ("_full", "order", "p", "top", "total")

    def __init__(self, p: torch.Tensor, total: torch.Tensor, top: torch.Tensor, order: torch.Tensor) -> None:
        self.p, self.total, self.top, self.order = p, total, top, order
        self._full: Ranks | None = self if top.shape[-1] == p.shape[-1] else None

    def __getitem__(self, rows: slice | torch.Tensor) -> Ranks:
        return Ranks(self.p[rows], self.total[rows], self.top[rows], self.order[rows])

    def complete(self) -> bool:
        return self._full is self

    def full(self) -> Ranks:
        if self._full is None:
            self._full = Ranks(self.p, self.total, *self.p.sort(dim=-1, descending=True))
        return self._full


def ranked(lp: torch.Tensor) -> Ranks:
    """The ranking of each row of lp; one ranking serves every support of the same lp."""
    p = lp.exp()
    v = p.shape[-1]
    m = min(PREFIX, v) if lp.device.type == "cpu" else v
    top, order = p.topk(m, dim=-1) if m < v else p.sort(dim=-1, descending=True)
    return Ranks(p, p.sum(-1, keepdim=True), top, order)


def support(lp: torch.Tensor, settings: RowSettings, slack_p: float = 0.0, slack_lp: float = 0.0,
            ranks: Ranks | None = None) -> torch.Tensor:
    """lp with the tokens outside each row's top-k/top-p support set to -inf (step 2 of the draw); `ranks`,
    where given, is `ranked(lp)`.

    The auditor moves the edges for a worker that computed them in lower precision. Positive slacks widen the
    support: every token within `slack_lp` nats of the k-th is kept, and `slack_p` is added to top-p, with only
    the tokens more likely by more than `slack_lp` counted before each (`_band_before`). Negative ones narrow it
    to the tokens inside it for any such worker: those at least |slack_lp| nats above the (k+1)-th, within
    top-p - |slack_p| with every token within |slack_lp| of each counted before it. A row without top-k whose
    top-p (or top-p + slack) is 1 keeps every token, whatever the other rows do."""
    if not settings.truncates():
        return lp
    ranks = ranked(lp) if ranks is None else ranks
    whole = ((settings.top_k <= 0) & ((settings.top_p >= 1) | (settings.top_p + slack_p >= 1))).unsqueeze(-1)
    kept = _kept(ranks, settings, slack_p, slack_lp)
    if not ranks.complete():
        # A row's support reaches the prefix's last token (supports are prefixes of the ranking), or its k-th
        # token lies past it: rank the whole vocabulary.
        past = kept[:, -1:] | (settings.top_k.unsqueeze(-1) >= ranks.top.shape[-1])
        if bool((past & ~whole).any()):
            ranks = ranks.full()
            kept = _kept(ranks, settings, slack_p, slack_lp)
    inside = torch.zeros_like(lp, dtype=torch.bool).scatter(-1, ranks.order, kept) | whole
    return lp.masked_fill(~inside, _NEG_INF)


def _kept(ranks: Ranks, settings: RowSettings, slack_p: float, slack_lp: float) -> torch.Tensor:
    """[R, m]: whether each ranked token is in its row's support. The top-k mass is the last cumulative sum
    (sequential on a CPU, so a prefix and the full ranking agree on it bit for bit); without top-k it is
    `total`."""
    top, m = ranks.top, ranks.top.shape[-1]
    k = settings.top_k.unsqueeze(-1)
    in_k = (k <= 0) | (torch.arange(m, device=top.device) < k)
    edge = top.gather(-1, (k - (1 if slack_lp >= 0 else 0)).clamp(0, m - 1))
    if slack_lp > 0:
        in_k = in_k | (top >= edge * math.exp(-slack_lp))
    elif slack_lp < 0:
        in_k = in_k & ((k <= 0) | (k >= m) | (top >= edge * math.exp(-slack_lp)))
    masked = top.masked_fill(~in_k, 0.0)
    mass = masked.cumsum(-1)
    total = torch.where(k <= 0, ranks.total, mass[:, -1:])
    top_p = (settings.top_p + slack_p).clamp(min=1e-6, max=1.0).unsqueeze(-1)
    before = mass - masked if not slack_lp else _band_before(top, mass, masked, slack_lp)
    return (masked > 0) & (before < top_p * total)


def _band_before(top: torch.Tensor, mass: torch.Tensor, masked: torch.Tensor, slack_lp: float) -> torch.Tensor:
    """[R, m]: the mass a worker whose logprobs are within |slack_lp| nats of these may rank before each token:
    widening (slack_lp > 0), only the tokens more likely than it by more than slack_lp; narrowing, also every token
    within |slack_lp| of it. Not the mass ranked before it here: in a flat stretch of the distribution such a worker
    re-orders many tokens of nearly its probability, which moves a nucleus edge by far more than their error."""
    ascending = (-top).contiguous()
    ahead = torch.searchsorted(ascending, (-top * math.exp(slack_lp)).contiguous())  # tokens above p * e^slack
    cum = torch.nn.functional.pad(mass, (1, 0))  # cum[:, c] = the mass of the first c ranked tokens
    return cum.gather(-1, ahead) - (masked if slack_lp < 0 else 0.0)


def _blocks(scores: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R, nb, BLOCK], padded with -inf."""
    r, v = scores.shape
    pad = -v % BLOCK
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=_NEG_INF)
    return scores.view(r, -1, BLOCK)


def _block_scores(masked: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """L_b + G for every block, [R, nb]."""
    blocks = _blocks(masked)
    mass = torch.logsumexp(blocks, dim=-1)
    nb = blocks.shape[1]
    keys = row_keys(seeds, positions, BLOCK_SALT)
    return mass + gumbel(keys, torch.arange(nb, device=masked.device))


def _token_scores(masked: torch.Tensor, block: torch.Tensor, seeds: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lp_i + G for the tokens of each row's block, [R, BLOCK], and their token ids."""
    ids = block.unsqueeze(-1) * BLOCK + torch.arange(BLOCK, device=masked.device)
    lp = _blocks(masked).gather(1, block.view(-1, 1, 1).expand(-1, 1, BLOCK)).squeeze(1)
    keys = row_keys(seeds, positions, TOKEN_SALT)
    return lp + gumbel(keys, ids), ids


def draw(logits: torch.Tensor, settings: RowSettings, seeds: torch.Tensor,
         positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its behaviour logprob: ([R] int64, [R] float32). `seeds` and `positions` are
    [R] integer tensors on the logits' device."""
    lp = logprobs(logits, settings)
    masked = support(lp, settings)
    block = _block_scores(masked, seeds, positions).argmax(-1)
    scores, ids = _token_scores(masked, block, seeds, positions)
    token = ids.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
    if settings.has_greedy():
        token = torch.where(settings.temperature <= 0, logits.argmax(-1), token)
    return token, lp.gather(-1, token.unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class Replay:
    """The replay of claimed tokens, [N] each."""

    gap: torch.Tensor  # float32 >= 0: how far below the best score the claimed token's score is (both stages)
    outside: torch.Tensor  # bool: the claimed token lies outside even the widened support
    chosen: torch.Tensor  # int64: the token the replay draws


def replay(logits: torch.Tensor, tokens: torch.Tensor, settings: RowSettings, seeds: torch.Tensor,
           positions: torch.Tensor, slack_p: float = 0.0, slack_lp: float = 0.0, *, lp: torch.Tensor | None = None,
           ranks: Ranks | None = None, exact: torch.Tensor | None = None, wide: torch.Tensor | None = None) -> Replay:
    """Replay the draw at N positions (logits [N, V] under the claimed weights) against the claimed tokens.

    The gap of a token is the larger of its block's and its own shortfall: max_b(L_b + G_b) - (L_y + G_y),
    and likewise among its block's tokens. Where the worker computed the support's edges in lower precision,
    the best scores are taken over the support narrowed by the slacks (tokens in it for any such worker) and
    the claimed token is scored in the support widened by them (`support`); only a token outside the widened
    support is `outside`. With no slack both are the support itself. `lp` (= logprobs(logits, settings)),
    `ranks` (= ranked(lp)), `exact` (= support(lp, settings)) and `wide` (= support(lp, settings, slack_p,
    slack_lp)), where the caller has them, are not computed again."""
    lp = logprobs(logits, settings) if lp is None else lp
    if ranks is None and settings.truncates():
        ranks = ranked(lp)
    sure = support(lp, settings, -slack_p, -slack_lp, ranks)
    wide = support(lp, settings, slack_p, slack_lp, ranks) if wide is None else wide
    exact = support(lp, settings, ranks=ranks) if exact is None else exact
    # Without truncation the three supports are lp itself: score its blocks once, not three times.
    block_scores: dict[int, torch.Tensor] = {}
    for masked in (sure, wide, exact):
        block_scores.setdefault(id(masked), _block_scores(masked, seeds, positions))
    own_block = tokens // BLOCK
    block_best = block_scores[id(sure)].max(-1).values
    block_mine = block_scores[id(wide)].gather(-1, own_block.unsqueeze(-1)).squeeze(-1)
    best_tok, _ = _token_scores(sure, own_block, seeds, positions)
    wide_tok = best_tok if wide is sure else _token_scores(wide, own_block, seeds, positions)[0]
    mine = wide_tok.gather(-1, (tokens % BLOCK).unsqueeze(-1)).squeeze(-1)
    gap = torch.maximum(block_best - block_mine, best_tok.max(-1).values - mine).clamp(min=0)
    outside = ~torch.isfinite(mine)
    gap = torch.where(outside | torch.isnan(gap), torch.full_like(gap, float("inf")), gap)
    chosen_block = block_scores[id(exact)].argmax(-1)
    best, best_ids = _token_scores(exact, chosen_block, seeds, positions)
    chosen = best_ids.gather(-1, best.argmax(-1, keepdim=True)).squeeze(-1)
    return Replay(gap=gap, outside=outside, chosen=chosen)
