"""Policy-side tensors: padded batches, per-token logprobs, micro-batches, one sample per prompt (through the
learner's sampler, learner/sampling.py) and the GRPO update (`grpo_update`: rollouts in, one optimiser step out).

Layout of a batch. Prompts are LEFT-padded to a common length P and completions RIGHT-padded to a
common length C, so every completion starts at column P:

    [pad pad p1 p2 p3 | c1 c2 c3 eos pad]      attention_mask 0 on pads, 1 elsewhere
                       ^ column P               completion_mask [1 1 1 1 0] over the last C columns

Position ids count real tokens only (cumsum of the attention mask), so a left-padded row sees the
same positions as the unpadded sequence a worker (vLLM, transformers) generated from.

The behaviour logprob of a sampled token is log softmax(logits / temperature)[token] over the FULL
vocabulary: no top-k/top-p truncation. Workers report exactly this; the learner recomputes it with
`completion_logprobs` and both must agree up to numerics. With sampler-support replay
(grpo.support_replay), `support_logprobs` also gives the log-mass of the top-k/top-p support the sampler
drew from, replayed on the learner's logits (objective.py, step 2c).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from echo2.sampler import RowSettings, support
from echo2.seeds import sample_seed

from learner.objective import (
    ObjectiveConfig,
    group_advantages,
    grpo_loss,
    loss_denominator,
    mismatch_keys,
    mismatch_summary,
)
from learner.parallel import Solo


@dataclass(frozen=True)
class PaddedBatch:
    input_ids: torch.Tensor  # [B, P + C] long
    attention_mask: torch.Tensor  # [B, P + C] long
    completion_mask: torch.Tensor  # [B, C] float, 1 on real completion tokens
    prompt_len: int  # P

    @property
    def completion_len(self) -> int:
        return self.completion_mask.shape[1]

    def to(self, device: torch.device) -> PaddedBatch:
        return PaddedBatch(self.input_ids.to(device), self.attention_mask.to(device),
                           self.completion_mask.to(device), self.prompt_len)

    def select(self, rows: Sequence[int]) -> PaddedBatch:
        """Rows of this batch, trimmed to the columns they use (for micro-batches)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        am = self.attention_mask[idx]
        cm = self.completion_mask[idx]
        first = int(am[:, : self.prompt_len].sum(-1).max())
        # Completions are right-padded: their attention counts every token, a multi-turn row's environment turns
        # too (its completion mask does not, and its last model turn comes after them).
        last = int(am[:, self.prompt_len:].sum(-1).max()) if cm.numel() else 0
        left = self.prompt_len - first
        right = self.prompt_len + max(last, 1)
        return PaddedBatch(
            input_ids=self.input_ids[idx, left:right],
            attention_mask=am[:, left:right],
            completion_mask=cm[:, : max(last, 1)],
            prompt_len=first,
        )


def pad_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int,
              masks: Sequence[Sequence[bool] | None] | None = None) -> PaddedBatch:
    """Left-pad prompts, right-pad completions (see module docstring). Empty completions are allowed.
    `masks` (one per row, None for all) keeps a multi-turn row's environment tokens out of the
    completion mask: they are context the model reads, not tokens it is trained to produce."""
    if len(prompts) != len(completions):
        raise ValueError("prompts and completions must have the same length")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    p_len = max(len(p) for p in prompts)
    c_len = max(1, max((len(c) for c in completions), default=1))
    b = len(prompts)
    input_ids = torch.full((b, p_len + c_len), pad_id, dtype=torch.long)
    attention = torch.zeros((b, p_len + c_len), dtype=torch.long)
    completion_mask = torch.zeros((b, c_len), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        input_ids[i, p_len - len(p) : p_len] = torch.as_tensor(list(p), dtype=torch.long)
        attention[i, p_len - len(p) : p_len] = 1
        if c:
            input_ids[i, p_len : p_len + len(c)] = torch.as_tensor(list(c), dtype=torch.long)
            attention[i, p_len : p_len + len(c)] = 1
            completion_mask[i, : len(c)] = 1.0
            if masks and masks[i] is not None:
                completion_mask[i, : len(c)] = torch.as_tensor(list(masks[i]), dtype=torch.float32)  # type: ignore[arg-type]
    return PaddedBatch(input_ids, attention, completion_mask, p_len)


def pad_values(rows: Sequence[Sequence[float]], width: int, fill: float = 0.0) -> torch.Tensor:
    """Right-pad per-token values (e.g. behaviour logprobs) to [len(rows), width] float32."""
    out = torch.full((len(rows), width), fill, dtype=torch.float32)
    for i, row in enumerate(rows):
        n = min(len(row), width)
        if n:
            out[i, :n] = torch.as_tensor(list(row[:n]), dtype=torch.float32)
    return out


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only; pads get 0 (they are masked anyway)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_logits(model: torch.nn.Module, batch: PaddedBatch, temperature: float) -> torch.Tensor:
    """float32 logits / temperature of the rows predicting each completion token, [B, C, V]. Only those C
    rows are materialised (logits_to_keep)."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0 for logprobs")
    c = batch.completion_len
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=position_ids(batch.attention_mask),
        logits_to_keep=c + 1,
        use_cache=False,
    )
    return out.logits[:, :-1, :].float() / temperature  # row j predicts completion token j


def completion_logprobs(
    model: torch.nn.Module, batch: PaddedBatch, *, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature) of each completion token, [B, C]; 0 on padding. Gathered as
    logit[token] - logsumexp(logits), never a full [B, T, V] log-softmax."""
    logits = completion_logits(model, batch, temperature)
    picked = logits.gather(-1, batch.input_ids[:, -batch.completion_len:].unsqueeze(-1)).squeeze(-1)
    return (picked - torch.logsumexp(logits, dim=-1)) * batch.completion_mask


SUPPORT_ROWS = 512  # token positions whose support is sorted at once: bounds the [rows, V] sort


def support_logprobs(model: torch.nn.Module, batch: PaddedBatch, settings: RowSettings
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs, log-mass of the sampler's support, outside), each [B, C]: the completion logprobs as
    `completion_logprobs`, log Z = logsumexp over the top-k/top-p support that `settings` (one row) replays
    on these logits (echo2.sampler.support), and whether the token lies outside it. 0 on padding."""
    logits = completion_logits(model, batch, float(settings.temperature[0]))
    lp = torch.log_softmax(logits, dim=-1)
    b, c, v = lp.shape
    flat = lp.detach().reshape(-1, v)
    inside = torch.empty_like(flat, dtype=torch.bool)
    with torch.no_grad():
        for start in range(0, flat.shape[0], SUPPORT_ROWS):
            rows = flat[start:start + SUPPORT_ROWS]
            one = RowSettings(*(t[:1].expand(rows.shape[0]) for t in (settings.temperature, settings.top_k,
                                                                      settings.top_p)))
            inside[start:start + SUPPORT_ROWS] = torch.isfinite(support(rows, one))
    inside = inside.view(b, c, v)
    targets = batch.input_ids[:, -c:].unsqueeze(-1)
    mask = batch.completion_mask
    log_mass = torch.logsumexp(lp.masked_fill(~inside, float("-inf")), dim=-1)
    outside = ~inside.gather(-1, targets).squeeze(-1) & mask.bool()
    return lp.gather(-1, targets).squeeze(-1) * mask, log_mass * mask, outside


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Split row indices into micro-batches of at most `max_tokens` padded tokens each.

    Rows are sorted by length so similar lengths share a micro-batch (little padding); a single row
    longer than the budget gets a micro-batch of its own. Order inside the step does not matter
    because the loss divisor is global (see objective.loss_denominator).
    """
    if max_tokens <= 0:
        raise ValueError("max_tokens must be positive")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        longest_if_added = max(longest, lengths[i])
        if current and longest_if_added * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest_if_added = [], lengths[i]
        current.append(i)
        longest = longest_if_added
    if current:
        batches.append(current)
    return batches


@dataclass(frozen=True)
class Sample:
    completion_ids: list[int]  # includes the eos token when the model stopped by itself
    logprobs: list[float]  # behaviour logprob of each completion token
    finished: bool  # True when eos was sampled before max_new_tokens


def sample(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    seed: int = 0,
) -> list[Sample]:
    """One sample per prompt, drawn by the learner's sampler (learner/sampling.py, the Tinker host's too): row i
    with the replayable sampler from seed sample_seed(seed, i), token j at position j, stopping after eos_id
    (none where it is negative). temperature = 0 means greedy; logprobs are then reported at temperature 1."""
    from echo2.protocol.tinker import SampleParams, SamplePayload

    from learner.sampling import sample as draw_samples

    params = SampleParams(max_tokens=max_new_tokens, temperature=temperature, stop_tokens=[eos_id] if eos_id >= 0
                          else [])
    payloads = [SamplePayload(prompt=list(p), num_samples=1, params=params) for p in prompts]
    seeds = [[sample_seed(seed, i)] for i in range(len(prompts))]
    out = draw_samples(model, None, payloads, eos_id, row_seeds=seeds, pad_id=pad_id)
    return [Sample(s.tokens, s.logprobs, s.stop_reason == "stop") for r in out for s in r.sequences]


@dataclass
class Rollouts:
    """One optimiser step's worth of scored rollouts (rows = samples; a group = one prompt's samples).
    The trainer fills it row by row (`add`); `grpo_update` takes it whole."""

    prompt_ids: list[list[int]] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)
    behaviour_logprobs: list[list[float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    group_ids: list[int] = field(default_factory=list)
    # learner step - policy version that sampled the row: one value, or one per token (partial rollouts)
    staleness: list[int | list[int]] = field(default_factory=list)
    model_masks: list[list[bool] | None] = field(default_factory=list)  # multi-turn: True on the model's tokens

    def add(self, prompt: list[int], completion: list[int], logprobs: list[float], reward: float, group: int,
            staleness: int | list[int], model_mask: list[bool] | None = None) -> None:
        self.model_masks.append(model_mask)
        self.prompt_ids.append(prompt)
        self.completion_ids.append(completion)
        self.behaviour_logprobs.append(logprobs)
        self.rewards.append(reward)
        self.group_ids.append(group)
        self.staleness.append(staleness)


@dataclass(frozen=True)
class _Plan:
    """Everything one optimiser step needs besides the model: the padded batch, advantages, the
    global loss divisor, and which rows are trained."""

    batch: PaddedBatch
    behaviour: torch.Tensor
    staleness: torch.Tensor  # [B, C]: of each completion token
    advantages: torch.Tensor
    denominator: float
    rows: list[int]  # kept rows
    lengths: list[int]  # of every row
    dropped: int  # groups whose rewards were all equal (no signal)


def grpo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rollouts: Rollouts,
    cfg: ObjectiveConfig,
    *,
    temperature: float = 1.0,
    max_tokens_per_micro_batch: int = 16384,
    grad_clip: float | None = 1.0,
    ref_model: torch.nn.Module | None = None,
    pad_id: int = 0,
    world: Solo | None = None,
    computing: Callable[[], AbstractContextManager[None]] = nullcontext,
    support: tuple[int, float] | None = None,
) -> dict[str, Any]:
    """Advantages -> micro-batched loss with one global divisor -> one optimiser step.

    The forward and backward run inside `computing()`: the model holding the weights it publishes
    (learner/rounding.py); the optimiser then steps the masters. `support` = (top_k, top_p) replays the
    sampler's support (objective.py, step 2c).

    Skips the step (stats["stepped"] = 0) when every group was dropped. Stats are token-weighted means;
    stats["mismatch"] is objective.mismatch_summary's list (behaviour against learner, per staleness).
    A loss or gradient that is not finite never reaches the weights: the groups causing it are found
    one by one (`_poisoned_groups`), dropped and listed in stats["poisoned_groups"], and the step is
    taken on the others.

    With a `parallel.Sharded` world (an FSDP-wrapped model, every rank calling with the same rollouts),
    each rank takes its share of every micro-batch (`world.share`). Advantages and the divisor are
    computed over the whole step as above, so the per-rank losses add up to the single-process loss;
    FSDP averages gradients over ranks, hence each rank's loss is scaled by the world's size. Every rank
    runs one pass per micro-batch, because FSDP's collectives must line up: a rank with no row of its
    own runs one with weight 0. Stats and the finiteness checks are over all ranks (`world.total`), so
    every rank drops the same groups.
    """
    settings = None if support is None else RowSettings.of([(temperature, *support)], "cpu")
    dropout = _drops_out(model)
    pass_ = _Pass(model, ref_model, cfg, temperature, max_tokens_per_micro_batch, grad_clip, world or Solo(),
                  computing, settings, dropout)
    plan = _plan(rollouts, cfg, pad_id, exclude=set())
    stats: dict[str, Any] = {"stepped": 0.0, "dropped_groups": float(plan.dropped),
                             "kept_samples": float(len(plan.rows)), "poisoned_groups": [], "mismatch": []}
    if not plan.rows:
        return stats
    model.train()
    totals, grad_norm = pass_.backward(plan, plan.rows)
    if not _finite(totals, grad_norm):
        poisoned = _poisoned_groups(pass_, plan, rollouts.group_ids)
        plan = _plan(rollouts, cfg, pad_id, exclude=poisoned)
        stats.update(poisoned_groups=sorted(poisoned), kept_samples=float(len(plan.rows)))
        if not plan.rows:
            optimizer.zero_grad(set_to_none=True)
            return stats
        totals, grad_norm = pass_.backward(plan, plan.rows)
    optimizer.step()
    tokens = max(totals.pop("tokens"), 1.0)
    stats.update({k: totals[k] / tokens for k in TOTALS[2:]})
    stats.update({"stepped": 1.0, "loss": totals["loss"], "grad_norm": grad_norm, "tokens": tokens,
                  "mismatch": mismatch_summary(totals, cfg.max_staleness)})
    return stats


def _plan(rollouts: Rollouts, cfg: ObjectiveConfig, pad_id: int, exclude: set[int]) -> _Plan:
    """Advantages over the step (groups in `exclude` left out), the padded batch and the divisor."""
    adv = group_advantages(torch.tensor(list(rollouts.rewards), dtype=torch.float32),
                           torch.tensor(list(rollouts.group_ids)), scale_by_std=cfg.scale_by_std, eps=cfg.std_eps)
    keep = adv.keep & torch.tensor([g not in exclude for g in rollouts.group_ids], dtype=torch.bool)
    batch = pad_batch(rollouts.prompt_ids, rollouts.completion_ids, pad_id, rollouts.model_masks)
    return _Plan(
        batch=batch, behaviour=pad_values(rollouts.behaviour_logprobs, batch.completion_len),
        staleness=token_staleness(rollouts, batch.completion_len), advantages=adv.advantages,
        denominator=loss_denominator(batch.completion_mask, keep, cfg),
        rows=[i for i, k in enumerate(keep.tolist()) if k],
        lengths=[len(p) + len(c) for p, c in zip(rollouts.prompt_ids, rollouts.completion_ids, strict=True)],
        dropped=adv.num_dropped,
    )


def token_staleness(rollouts: Rollouts, width: int) -> torch.Tensor:
    """[B, width] staleness of every completion token: a row's single value on each of its tokens, or its
    per-token values (a partial rollout's later tokens come from newer versions)."""
    rows = [[s] * len(c) if isinstance(s, int) else s
            for s, c in zip(rollouts.staleness, rollouts.completion_ids, strict=True)]
    return pad_values(rows, width)


def _drops_out(model: torch.nn.Module) -> bool:
    """Whether the model drops out in training: a dropout module (a LoRA adapter's), or attention dropout its
    config sets (applied functionally, as Llama-style attention does)."""
    config = getattr(model, "config", None)
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) \
        or float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0


@dataclass(frozen=True)
class _Pass:
    """Forward + backward of chosen rows of a plan, micro-batched, gradients clipped (not stepped)."""

    model: torch.nn.Module
    ref_model: torch.nn.Module | None
    cfg: ObjectiveConfig
    temperature: float
    max_tokens: int
    grad_clip: float | None
    world: Solo
    computing: Callable[[], AbstractContextManager[None]] = nullcontext
    support: RowSettings | None = None  # the sampler's settings, to replay its support (one row)
    dropout: bool = False  # the model drops out in training (a LoRA adapter's dropout): logold needs its own pass

    def backward(self, plan: _Plan, rows: list[int]) -> tuple[dict[str, float], float]:
        """Returns the summed stats (over ranks) and the gradient norm before clipping."""
        self.model.zero_grad(set_to_none=True)
        # every key on every rank: ranks sum them in one order
        totals = dict.fromkeys((*TOTALS, *mismatch_keys(self.cfg.max_staleness)), 0.0)
        device = next(self.model.parameters()).device
        with self.computing():
            for part in micro_batches([plan.lengths[i] for i in rows], self.max_tokens):
                mine = self.world.share(part)
                chosen = [rows[j] for j in (mine or part[:1])]
                loss, mb_stats = self._loss(plan, chosen, device)
                (loss * (self.world.size if mine else 0.0)).backward()
                if mine:
                    _accumulate(totals, mb_stats, float(loss.detach()))
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or float("inf"))
        return self.world.total(totals, grad_norm, device)

    def _loss(self, plan: _Plan, rows: list[int], device: torch.device) -> tuple[torch.Tensor, dict[str, float]]:
        mb = plan.batch.select(rows).to(device)
        behaviour = plan.behaviour[rows, : mb.completion_len].to(device)
        with autocast(device):
            logprobs, log_mass, outside = self._logprobs(self.model, mb)
            behaviour = behaviour - log_mass.detach()  # step 2c: its mass cancels in the ratio
            old = ref = None
            with torch.no_grad():
                if self.dropout:  # logold is the published weights', which sample with no dropout
                    self.model.eval()
                    old = self._logprobs(self.model, mb)[0].float()
                    self.model.train()
                if self.ref_model is not None:  # over its own replayed support, as the policy's
                    ref = self._logprobs(self.ref_model, mb)[0].float()
        return grpo_loss(
            logprobs.float(), behaviour, plan.advantages[rows].to(device), mb.completion_mask,
            plan.staleness[rows, : mb.completion_len].to(device), self.cfg,
            ref_logprobs=ref, denominator=plan.denominator, outside=outside, old_logprobs=old,
        )

    def _logprobs(self, model: torch.nn.Module, mb: PaddedBatch
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(logprobs, log-mass, outside): over the whole vocabulary (mass 0, nothing outside), or with support
        replay (objective.py step 2c) renormalised over the sampler's support."""
        if self.support is None:
            logprobs = completion_logprobs(model, mb, temperature=self.temperature)
            return logprobs, torch.zeros_like(logprobs), None
        logprobs, log_mass, outside = support_logprobs(model, mb, self.support)
        return logprobs - log_mass, log_mass, outside


def _poisoned_groups(pass_: _Pass, plan: _Plan, group_ids: Sequence[int]) -> set[int]:
    """Groups whose own loss or gradient is not finite (every rank tests the same groups in order)."""
    by_group: dict[int, list[int]] = {}
    for i in plan.rows:
        by_group.setdefault(group_ids[i], []).append(i)
    return {g for g, rows in by_group.items() if not _finite(*pass_.backward(plan, rows))}


def _finite(totals: dict[str, float], grad_norm: float) -> bool:
    return math.isfinite(grad_norm) and all(math.isfinite(v) for v in totals.values())


def autocast(device: torch.device) -> torch.autocast:
    """What the step computes in: bf16 on CUDA (master weights stay fp32); plain fp32 elsewhere."""
    use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)


TOTALS = ("tokens", "loss", "clip_frac", "cap_frac", "ratio_mean", "kl")


def _accumulate(totals: dict[str, float], mb_stats: dict[str, float], loss: float) -> None:
    n = mb_stats["tokens"]
    totals["tokens"] = totals.get("tokens", 0.0) + n
    totals["loss"] = totals.get("loss", 0.0) + loss  # micro-batch losses share one divisor: they add up
    for key in TOTALS[2:]:
        totals[key] = totals.get(key, 0.0) + mb_stats[key] * n
    for key, value in mb_stats.items():
        if key.startswith("mismatch/"):  # already sums
            totals[key] = totals.get(key, 0.0) + value
