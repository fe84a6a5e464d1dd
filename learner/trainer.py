"""One GRPO step over claimed groups, top to bottom: refuse groups that do not fit the model or fail the
audit the control plane asked for (learner/auditor.py), score the rest on the trusted side, build the
padded batch, advantages, loss with gradient accumulation, optimiser step (policy.grpo_update, which
also drops groups whose loss or gradient is not finite). The loss itself is in objective.py. Every
refused group is reported with its reason; none of them is trained. A group the task could not score
(its endpoint down, an exception, a timeout) is not trained either: it is audited, then reported as unscored, the
platform's fault, and goes back to the pool (or refused, if it failed that audit).

With FSDP (`parallel.Sharded`), rank 0 scores (rewards stay computed once, on the trusted side) and
announces the scored rows; every rank then runs `optimise` on its share of them (policy.grpo_update)."""

from __future__ import annotations

import logging
import math
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from echo2.prompting import encode_prompt
from echo2.protocol import AuditReport, ClaimedGroup, JobSpec, LrSchedule, SampleSubmit

from tasks import TaskPrompt, get_task

from .auditor import Auditor
from .objective import ObjectiveConfig
from .parallel import Solo
from .policy import Rollouts, grpo_update
from .traces import learner_logprobs
from .weights import Weights

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
    mismatch: list[dict[str, float]] = field(default_factory=list)  # objective.mismatch_summary
    seconds: float = 0.0
    rejected: dict[str, str] = field(default_factory=dict)  # rollout id -> why it was not trained
    unscored: dict[str, str] = field(default_factory=dict)  # rollout id -> why the task could not score it
    learner_logprobs: dict[str, list[list[float]]] = field(default_factory=dict)  # per sample, for traces
    audits: list[AuditReport] = field(default_factory=list)
    audit_s: float = 0.0


def objective_config(spec: JobSpec) -> ObjectiveConfig:
    g = spec.grpo
    return ObjectiveConfig(eps_low=g.eps_low, eps_high=g.eps_high, ratio_cap=g.ratio_cap, kl_coef=g.kl_coef,
                           length_norm=g.loss_agg.value, max_len=g.max_new_tokens, scale_by_std=g.scale_rewards,
                           correction=g.correction.value, correction_level=g.correction_level.value,
                           correction_low=g.correction_low, correction_high=g.correction_high,
                           max_staleness=spec.staleness)


class GRPOTrainer:
    def __init__(self, model: Any, tokenizer: Any, spec: JobSpec, ref_model: Any = None, world: Solo | None = None,
                 auditor: Auditor | None = None):
        self.model, self.tokenizer, self.spec, self.ref_model = model, tokenizer, spec, ref_model
        self.world = world or Solo()
        self.auditor = auditor
        self.weights: Weights = Weights(model, tokenizer, torch.float32, self.world)  # what versions carry
        self.verdicts: dict[str, AuditReport] = {}  # audits made as groups were claimed (audit_claimed)
        self.early_audit_s = 0.0  # their time, counted in the next step's audit_s
        # Senders of a group that failed its audit here (or did not fit the model): their groups this learner holds
        # are all audited before they train. The control plane audits every group a worker sends once it is
        # struck, but groups claimed before then were claimed unpicked, and would train unjudged beside the one
        # that failed.
        self.struck: set[str] = set()
        self.task = get_task(spec.task.name)
        self.task_params = self.task.parse_params(spec.task.params)
        self.cfg = objective_config(spec)
        g = spec.grpo
        trainable = [p for p in model.parameters() if p.requires_grad]  # a LoRA job's adapter only
        # One fused kernel for the whole step on a GPU (not with FSDP's sharded parameters)
        fused = type(self.world) is Solo and all(p.is_cuda for p in trainable) or None
        self.optimizer = torch.optim.AdamW(trainable, lr=g.lr, betas=g.adam_betas, eps=g.adam_eps,
                                           weight_decay=g.weight_decay, fused=fused)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, spec))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def step(self, groups: list[ClaimedGroup], t: int) -> StepResult:
        """Check, audit, score, train. Groups refused on the way are in `rejected`, never trained."""
        start = time.perf_counter()
        result = StepResult()
        groups = self._admit(groups, result)
        rows = self._score(groups, t, result)
        self._audit_unscored(groups, result)
        if rows.rewards:
            self._trace(groups, rows, result)
            self.world.announce("optimise", (rows, t))
            for gi in self.optimise(rows, result, t):
                result.rejected[groups[gi].rollout_id] = "its loss or gradient was not finite (poisoned logprobs)"
                result.rewards.pop(groups[gi].rollout_id, None)
        _reward_stats(result)
        self._schedule(t + 1)
        result.seconds = time.perf_counter() - start
        return result

    def _schedule(self, t: int) -> None:
        """The learning rate of learner step `t`: the schedule is per learner step, one with no optimiser step
        (every group without signal) included, else each such step delayed the whole schedule."""
        with warnings.catch_warnings():  # a step with no update steps the schedule too, as meant here
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            while self.scheduler.last_epoch < t:
                self.scheduler.step()

    def audit_claimed(self, groups: list[ClaimedGroup]) -> list[AuditReport]:
        """Audit the groups picked for it as soon as they are claimed, before the step: the verdicts go to the
        control plane at once (a worker on probation gets more work once its groups are judged) and the step
        uses them."""
        return [self._judge_early(group) for group in groups if group.audit and self._unjudged(group)]

    def audit_spare(self, groups: list[ClaimedGroup], budget_s: float) -> list[AuditReport]:
        """Audit claimed groups the control plane did not pick, for about `budget_s` of audit time: the learner
        calls this only while it would otherwise wait for rollouts (learner/loop.py), so a trusted worker's
        groups outside its audit windows are judged in time nobody was using. One group of each sender in
        turn, so a worker with many groups queued does not use up the time of the others. The verdicts count
        as any audit's (a failed one strikes the sender and the group is refused)."""
        start = self.auditor.seconds if self.auditor else 0.0
        made: list[AuditReport] = []
        for group in _round_robin([g for g in groups if not g.audit and self._unjudged(g)]):
            if self.auditor is None or self.auditor.seconds - start >= budget_s:
                break
            made.append(self._judge_early(group))
        return made

    def _unjudged(self, group: ClaimedGroup) -> bool:
        return self.auditor is not None and group.rollout_id not in self.verdicts and self._misfit(group) is None

    def _judge_early(self, group: ClaimedGroup) -> AuditReport:
        """Audit a claimed group before its step; the step uses the verdict (_audit), its time counts in the step's
        audit_s."""
        assert self.auditor is not None
        start = self.auditor.seconds
        report = self.verdicts[group.rollout_id] = self._verdict(group)
        self.early_audit_s += self.auditor.seconds - start
        return report

    def _verdict(self, group: ClaimedGroup) -> AuditReport:
        """Audit one group now; a sender that fails has its other held groups audited too (`struck`)."""
        assert self.auditor is not None
        verdict = self.auditor.audit(group)
        if not verdict.passed:
            self.struck.add(group.worker_id)
        return AuditReport(rollout_id=group.rollout_id, passed=verdict.passed, reason=verdict.reason,
                           stats=verdict.stats())

    def _admit(self, groups: list[ClaimedGroup], result: StepResult) -> list[ClaimedGroup]:
        """Groups that fit the model and, when picked for an audit, pass it."""
        kept = []
        audit_start = self.auditor.seconds if self.auditor else 0.0
        # Misfits, then the groups picked or judged already: one that fails has its sender's other groups audited.
        why: dict[str, str | None] = {g.rollout_id: misfit for g in groups if (misfit := self._misfit(g))}
        self.struck |= {g.worker_id for g in groups if g.rollout_id in why}
        why |= {g.rollout_id: self._audit(g, result) for g in groups
                if g.rollout_id not in why and (g.audit or g.rollout_id in self.verdicts)}
        why |= {g.rollout_id: self._audit(g, result) for g in groups if g.rollout_id not in why}
        for group in groups:
            if why[group.rollout_id]:
                result.rejected[group.rollout_id] = why[group.rollout_id]
            else:
                kept.append(group)
        result.audit_s = (self.auditor.seconds - audit_start) if self.auditor else 0.0
        result.audit_s, self.early_audit_s = result.audit_s + self.early_audit_s, 0.0
        return kept

    def _audit_unscored(self, groups: list[ClaimedGroup], result: StepResult) -> None:
        """A group the task could not score is paid as the platform's fault: each is audited first, so junk that
        makes a strict reward endpoint fail is refused as the forgery it is (its sender struck, unpaid), not paid.
        Honest fleets' groups go unscored only while the task fails, and a job whose task keeps failing pauses."""
        if self.auditor is None:
            return
        audited = {a.rollout_id for a in result.audits}
        start = self.auditor.seconds
        for group in groups:
            if group.rollout_id in result.unscored and group.rollout_id not in audited:
                result.audits.append(report := self._verdict(group))
                if not report.passed:
                    del result.unscored[group.rollout_id]
                    result.rejected[group.rollout_id] = f"failed its audit: {report.reason}"
        result.audit_s += self.auditor.seconds - start

    def _misfit(self, group: ClaimedGroup) -> str | None:
        vocab = self.model.get_input_embeddings().num_embeddings
        if max(max(s.token_ids) for s in group.samples) >= vocab:
            return f"a token id is outside the model's vocabulary ({vocab})"
        if list(group.prompt_token_ids) != encode_prompt(self.tokenizer, group.prompt_text, group.prompt_context):
            return "its prompt tokens are not the encoding of the leased prompt"
        return None

    def _audit(self, group: ClaimedGroup, result: StepResult) -> str | None:
        """The group's verdict: the one made when it was claimed (picked, or audited in spare time), else, when
        picked or its sender failed an audit here, one made now."""
        report = self.verdicts.pop(group.rollout_id, None)
        picked = group.audit or group.worker_id in self.struck
        if report is None and (not picked or self.auditor is None):
            return None
        if report is None:
            report = self._verdict(group)
        result.audits.append(report)
        return None if report.passed else f"failed its audit: {report.reason}"

    def _trace(self, groups: list[ClaimedGroup], rows: Rollouts, result: StepResult) -> None:
        """The learner's own logprob of each token, under the weights the step starts from (learner/traces.py);
        single-process learners only (a sharded forward needs every rank)."""
        if not self.spec.trace_logprobs or self.world.size > 1:
            return
        g = self.spec.grpo
        with self.weights.computing():  # the published weights, which the objective's ratio uses
            values = learner_logprobs(self.model, rows, self.pad_id, g.temperature, g.micro_batch_tokens)
        for gi, row in zip(rows.group_ids, values, strict=True):
            result.learner_logprobs.setdefault(groups[gi].rollout_id, []).append(row)

    def replay(self, groups: list[ClaimedGroup], rewards: dict[str, list[float | None]], t: int) -> StepResult:
        """Train a committed step again exactly as it was: its trained groups in order, with the rewards
        computed then (learner/resume.py)."""
        result = StepResult()
        rows = self._score(groups, t, result, rewards)
        if rows.rewards:
            self.world.announce("optimise", (rows, t))
            self.optimise(rows, result, t)
        self._schedule(t + 1)
        return result

    def _score(self, groups: list[ClaimedGroup], t: int, result: StepResult,
               given: dict[str, list[float | None]] | None = None) -> Rollouts:
        """Rewards are computed here (trusted), from the learner's own decoding of the tokens."""
        rows = Rollouts()
        hist = [0] * (self.spec.staleness + 1)
        scored = [given[g.rollout_id] for g in groups] if given is not None else self._rewards(groups)
        for gi, (group, rewards) in enumerate(zip(groups, scored, strict=True)):
            staleness = t - group.version
            assert self.spec.admissible(t, group.version), f"rollout {group.rollout_id} has staleness {staleness}"
            if isinstance(rewards, str) or any(r is None for r in rewards):
                result.unscored[group.rollout_id] = rewards if isinstance(rewards, str) else \
                    f"the {self.spec.task.name} task scored no reward for a sample"
                continue
            hist[staleness] += 1
            result.rewards[group.rollout_id] = rewards
            for sample, reward in zip(group.samples, rewards, strict=True):
                rows.add(list(group.prompt_token_ids), list(sample.token_ids), list(sample.logprobs),
                         float(reward), gi, sample_staleness(sample, group.version, t),  # type: ignore[arg-type]
                         None if sample.turns is None else sample.model_token_mask())
        result.staleness_hist = hist
        return rows

    def _rewards(self, groups: list[ClaimedGroup]) -> list[list[float | None] | str]:
        """Every group's rewards, or why they could not be computed; a task that calls out (http_reward) has
        `concurrency` calls in flight."""
        workers = self.task.concurrency(self.task_params)
        if workers <= 1:
            return [self._group_rewards(g) for g in groups]
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(self._group_rewards, groups))

    def _group_rewards(self, group: ClaimedGroup) -> list[float | None] | str:
        if group.rewards is not None:  # a multi-turn group: its environment's rewards, from the control plane
            return list(group.rewards)
        prompt = TaskPrompt(text=group.prompt_text, reference=group.reference)
        rewards: list[float | None] = []
        for s in group.samples:  # the first sample it cannot score ends the group: no more calls out
            reward = self.task.reward_or_why(prompt, self.tokenizer.decode(s.token_ids, skip_special_tokens=True),
                                             self.task_params)
            if isinstance(reward, str):
                log.warning("rollout %s is not trained: %s", group.rollout_id, reward)
                return reward
            rewards.append(reward)
        return rewards

    def optimise(self, rows: Rollouts, result: StepResult, t: int) -> list[int]:
        """One optimiser step of learner step `t` (every rank: its learning rate is the step's); returns the groups
        (indices) dropped for a non-finite loss or gradient."""
        self._schedule(t)
        g = self.spec.grpo
        stats = grpo_update(self.model, self.optimizer, rows, self.cfg, temperature=g.temperature,
                            max_tokens_per_micro_batch=g.micro_batch_tokens, grad_clip=g.max_grad_norm,
                            ref_model=self.ref_model, pad_id=self.pad_id, world=self.world,
                            computing=self.weights.computing,
                            support=(g.top_k, g.top_p) if g.support_replay else None)
        result.groups_dropped += int(stats["dropped_groups"])
        result.loss, result.kl = stats.get("loss", 0.0), stats.get("kl", 0.0)
        result.clip_frac, result.tokens = stats.get("clip_frac", 0.0), int(stats.get("tokens", 0))
        result.mismatch = stats["mismatch"]
        return list(stats["poisoned_groups"])


def _round_robin(groups: list[ClaimedGroup]) -> list[ClaimedGroup]:
    """Each sender's first group, then each one's second, and so on (in claim order within a sender)."""
    rank: dict[str, int] = {}
    order = []
    for i, group in enumerate(groups):
        rank[group.worker_id] = rank.get(group.worker_id, -1) + 1
        order.append((rank[group.worker_id], i))
    return [groups[i] for _, i in sorted(order)]


def sample_staleness(sample: SampleSubmit, version: int, t: int) -> int | list[int]:
    """t - x for a sample of a group of version x; for a partial rollout, per token against the version that
    produced it (its importance ratio is capped as stale only where that token is)."""
    if sample.versions is None:
        return t - version
    return [t - v for v in sample.token_versions(version)]


def lr_factor(step: int, spec: JobSpec) -> float:
    """The learning rate at `step` as a share of grpo.lr: linear warm-up, then the schedule, which ends at
    min_lr_ratio at max_steps."""
    g = spec.grpo
    if step < g.warmup_steps:
        return (step + 1) / g.warmup_steps
    if g.lr_schedule is LrSchedule.constant:
        return 1.0
    done = min(1.0, (step - g.warmup_steps) / max(1, spec.max_steps - g.warmup_steps))
    decay = 1.0 - done if g.lr_schedule is LrSchedule.linear else 0.5 * (1.0 + math.cos(math.pi * done))
    return g.min_lr_ratio + (1.0 - g.min_lr_ratio) * decay


def _reward_stats(result: StepResult) -> None:
    rewards = [r for group in result.rewards.values() for r in group if r is not None]
    if rewards:
        r = torch.tensor(rewards, dtype=torch.float64)
        result.reward_mean, result.reward_std = float(r.mean()), float(r.std(unbiased=False))
