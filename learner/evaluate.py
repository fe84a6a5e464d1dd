"""Held-out evaluation on the learner: the job's held-out prompts (api/services/evals.py), answered by the
weights of one version, greedy and sampled at the job's temperature, scored by the task.

Why the learner and not the workers: the result is what users pay to improve, so it is computed on the
trusted side (a worker could report any accuracy; references never leave the control plane and the
learner), on exactly the weights of the version being measured, in float32. It costs learner time:
generation of `eval.size` prompts, up to max_new_tokens each, before the first step, every `eval.every`
steps and after the last — a few seconds on the tiny model, tens of seconds for SmolLM2 on CPU. Sampling
here applies the temperature but no top-k/top-p truncation; each batch of prompts draws from its own seed
(the job's seed, the step, the batch), so the figures do not depend on how the batches are spread.

Under FSDP (learner.gpus > 1) rank 0 announces the evaluation and every rank generates every size-th
batch on the sharded model, the ranks' forward passes kept in lockstep (parallel.Sharded.generating); the
rewards are gathered on rank 0, which reports them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from echo2.prompting import encode_prompt
from echo2.protocol import EvalPrompt, EvalReport, JobSpec

from tasks import TaskPrompt, derive_seed, get_task

from .parallel import Solo
from .policy import sample

log = logging.getLogger(__name__)
BATCH = 32  # prompts generated at once
ANSWER_CHARS = 4096  # of each greedy answer, reported


class Evaluator:
    def __init__(self, spec: JobSpec, prompts: list[EvalPrompt], model: Any, tokenizer: Any, pad_id: int,
                 world: Solo | None = None,
                 computing: Callable[[], AbstractContextManager[None]] = nullcontext) -> None:
        self.spec, self.prompts, self.model, self.tokenizer, self.pad_id = spec, prompts, model, tokenizer, pad_id
        self.world = world or Solo()
        self.computing = computing  # the model holding the published weights (learner/rounding.py)
        self.task = get_task(spec.task.name)
        self.params = self.task.parse_params(spec.task.params)

    def due(self, step: int) -> bool:
        """Before the first step, and every `eval.every` steps (the final step is asked for separately)."""
        every = self.spec.eval.every
        return bool(self.prompts) and (step == 0 or (every > 0 and step % every == 0))

    def run(self, step: int, version: int) -> EvalReport:
        """The report (on rank 0; on the other ranks, of their share alone, and not to be reported)."""
        start = time.perf_counter()
        self.world.announce("evaluate", (step, version, self.prompts))
        was_training = self.model.training
        self.model.eval()
        try:
            with self.computing(), self.world.generating(self.model) as model:
                greedy = self._rewards(model, 0.0, 0)
                sampled = self._rewards(model, self.spec.grpo.temperature, derive_seed("eval", self.spec.seed, step))
        finally:
            self.model.train(was_training)
        (greedy, answers), (sampled, _) = self._everyone(greedy), self._everyone(sampled)
        report = EvalReport(step=step, version=version, prompts=len(self.prompts),
                            greedy_accuracy=_accuracy(greedy), sampled_accuracy=_accuracy(sampled),
                            sampled_reward_mean=_mean(sampled), seconds=time.perf_counter() - start,
                            greedy_answers=[a[:ANSWER_CHARS] for a in answers])
        log.info("held-out accuracy at step %d: greedy %s, sampled %s (%d prompts, %.1fs)", step,
                 report.greedy_accuracy, report.sampled_accuracy, report.prompts, report.seconds)
        return report

    def _rewards(self, model: Any, temperature: float, seed: int) -> list[tuple[int, float | None, str]]:
        """(prompt index, reward, answer) of this rank's batches: every size-th one, from its rank's."""
        rewards: list[tuple[int, float | None, str]] = []
        for start in range(self.world.rank * BATCH, len(self.prompts), self.world.size * BATCH):
            batch = self.prompts[start:start + BATCH]
            ids = [encode_prompt(self.tokenizer, p.text, p.context) for p in batch]
            out = sample(model, ids, max_new_tokens=self.spec.grpo.max_new_tokens,
                         eos_id=self.tokenizer.eos_token_id, pad_id=self.pad_id, temperature=temperature,
                         seed=seed + start)
            for i, (p, s) in enumerate(zip(batch, out, strict=True)):
                text = self.tokenizer.decode(s.completion_ids, skip_special_tokens=True)
                rewards.append((start + i, self._score(TaskPrompt(text=p.text, reference=p.reference), text), text))
        return rewards

    def _score(self, prompt: TaskPrompt, text: str) -> float | None:
        """The reward, or None (counted as wrong) when the task cannot score it: an evaluation never stops the
        learner; the training groups it could not score pause the job."""
        reward = self.task.reward_or_why(prompt, text, self.params)
        if isinstance(reward, str):
            log.warning("held-out answer left unscored: %s", reward)
            return None
        return reward

    def _everyone(self, mine: list[tuple[int, float | None, str]]) -> tuple[list[float | None], list[str]]:
        """Every rank's rewards and answers, in prompt order."""
        ordered = sorted(self.world.gather(mine), key=lambda row: row[0])
        return [reward for _, reward, _ in ordered], [answer for _, _, answer in ordered]


def _accuracy(rewards: list[float | None]) -> float | None:
    """The share of prompts answered right (reward 1; an unscorable answer counts as wrong)."""
    return sum(r is not None and r >= 1.0 for r in rewards) / len(rewards) if rewards else None


def _mean(rewards: list[float | None]) -> float | None:
    scored = [r for r in rewards if r is not None]
    return sum(scored) / len(scored) if scored else None
