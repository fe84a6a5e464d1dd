"""One GRPO step over claimed groups, top to bottom: score on the trusted side, build the padded batch,
advantages, loss with gradient accumulation, optimiser step. The loss itself is in objective.py.

With FSDP (`parallel.Sharded`), rank 0 scores (rewards stay computed once, on the trusted side) and
announces the scored rows; every rank then runs `optimise` on its share of them (policy.grpo_update)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from echo2.prompting import encode_prompt
from echo2.protocol import ClaimedGroup, JobSpec

from learner.tasks import TaskPrompt, get_task

from .objective import ObjectiveConfig
from .parallel import Solo
from .policy import grpo_update

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    rewards: dict[str, list[float | None]] = field(default_factory=dict)
    reward_mean: float | None = None
    reward_std: float | None = None
    loss: float = 0.0
    kl: float = 0.0
    clip_frac: float = 0.0
    groups_dropped: int = 0
    tokens: int = 0
    staleness_hist: list[int] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _Rows:
    """Scored samples of one step, in the shape `policy.grpo_update` takes (`policy.Rollouts`)."""

    prompt_ids: list[list[int]] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)
    behaviour_logprobs: list[list[float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    group_ids: list[int] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)


def objective_config(spec: JobSpec) -> ObjectiveConfig:
    g = spec.grpo
    return ObjectiveConfig(eps_low=g.eps_low, eps_high=g.eps_high, ratio_cap=g.ratio_cap, kl_coef=g.kl_coef,
                           length_norm=g.loss_agg.value, max_len=g.max_new_tokens, scale_by_std=g.scale_rewards)


class GRPOTrainer:
    def __init__(self, model: Any, tokenizer: Any, spec: JobSpec, ref_model: Any = None, world: Solo | None = None):
        self.model, self.tokenizer, self.spec, self.ref_model = model, tokenizer, spec, ref_model
        self.world = world or Solo()
        self.task = get_task(spec.task.name)
        self.task_params = self.task.parse_params(spec.task.params)
        self.cfg = objective_config(spec)
        g = spec.grpo
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=g.lr, weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / g.warmup_steps) if g.warmup_steps else 1.0)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def step(self, groups: list[ClaimedGroup], t: int) -> StepResult:
        start = time.perf_counter()
        result = StepResult()
        rows = self._score(groups, t, result)
        if rows.rewards:
            self.world.announce("optimise", rows)
            self.optimise(rows, result)
        result.seconds = time.perf_counter() - start
        return result

    def _score(self, groups: list[ClaimedGroup], t: int, result: StepResult) -> _Rows:
        """Rewards are computed here (trusted), from the learner's own decoding of the tokens."""
        rows, all_rewards = _Rows(), []
        hist = [0] * (self.spec.staleness + 1)
        for gi, group in enumerate(groups):
            staleness = t - group.version
            assert 0 <= staleness <= self.spec.staleness, f"rollout {group.rollout_id} has staleness {staleness}"
            hist[staleness] += 1
            rewards = self._group_rewards(group)
            result.rewards[group.rollout_id] = rewards
            all_rewards += [r for r in rewards if r is not None]
            if any(r is None for r in rewards):
                result.groups_dropped += 1
                continue
            prompt_ids = list(group.prompt_token_ids)
            for sample, reward in zip(group.samples, rewards, strict=True):
                rows.prompt_ids.append(prompt_ids)
                rows.completion_ids.append(list(sample.token_ids))
                rows.behaviour_logprobs.append(list(sample.logprobs))
                rows.rewards.append(float(reward))  # type: ignore[arg-type]
                rows.group_ids.append(gi)
                rows.staleness.append(staleness)
        result.staleness_hist = hist
        if all_rewards:
            r = torch.tensor(all_rewards, dtype=torch.float64)
            result.reward_mean, result.reward_std = float(r.mean()), float(r.std(unbiased=False))
        return rows

    def _group_rewards(self, group: ClaimedGroup) -> list[float | None]:
        expected = encode_prompt(self.tokenizer, group.prompt_text)
        vocab = self.model.get_input_embeddings().num_embeddings
        if list(group.prompt_token_ids) != expected:
            log.warning("rollout %s: prompt tokens differ from the learner's; group ignored", group.rollout_id)
            return [None] * len(group.samples)
        prompt = TaskPrompt(text=group.prompt_text, reference=group.reference)
        out: list[float | None] = []
        for sample in group.samples:
            if max(sample.token_ids) >= vocab:
                out.append(None)
                continue
            text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            out.append(self.task.reward(prompt, text, self.task_params))
        return out

    def optimise(self, rows: _Rows, result: StepResult) -> None:
        g = self.spec.grpo
        stats = grpo_update(self.model, self.optimizer, rows, self.cfg, temperature=g.temperature,
                            max_tokens_per_micro_batch=g.micro_batch_tokens, grad_clip=g.max_grad_norm,
                            ref_model=self.ref_model, pad_id=self.pad_id, rank=self.world.rank,
                            world_size=self.world.size)
        if stats["stepped"]:
            self.scheduler.step()
        result.groups_dropped += int(stats["dropped_groups"])
        result.loss, result.kl = stats.get("loss", 0.0), stats.get("kl", 0.0)
        result.clip_frac, result.tokens = stats.get("clip_frac", 0.0), int(stats.get("tokens", 0))


