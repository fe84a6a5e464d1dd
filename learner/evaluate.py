"""Held-out evaluation on the learner: the job's held-out prompts (api/services/evals.py), answered by the
weights of one version, greedy and sampled at the job's temperature, scored by the task.

Why the learner and not the workers: the result is what users pay to improve, so it is computed on the
trusted side (a worker could report any accuracy; references never leave the control plane and the
learner), on exactly the weights of the version being measured, in float32. It costs learner time:
generation of `eval.size` prompts, up to max_new_tokens each, before the first step, every `eval.every`
steps and after the last — a few seconds on the tiny model, tens of seconds for SmolLM2 on CPU. Sampling
here applies the temperature but no top-k/top-p truncation. Runs in single-process learners (with
FSDP over several ranks it is skipped: every rank would have to generate in lockstep).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from echo2.prompting import encode_prompt
from echo2.protocol import EvalPrompt, EvalReport, JobSpec

from learner.tasks import TaskPrompt, derive_seed, get_task

from .policy import sample

log = logging.getLogger(__name__)
BATCH = 32  # prompts generated at once
ANSWER_CHARS = 4096  # of each greedy answer, reported


class Evaluator:
    def __init__(self, spec: JobSpec, prompts: list[EvalPrompt], model: Any, tokenizer: Any, pad_id: int) -> None:
        self.spec, self.prompts, self.model, self.tokenizer, self.pad_id = spec, prompts, model, tokenizer, pad_id
        self.task = get_task(spec.task.name)
        self.params = self.task.parse_params(spec.task.params)

    def due(self, step: int) -> bool:
        """Before the first step, and every `eval.every` steps (the final step is asked for separately)."""
        every = self.spec.eval.every
        return bool(self.prompts) and (step == 0 or (every > 0 and step % every == 0))

    def run(self, step: int, version: int) -> EvalReport:
        start = time.perf_counter()
        was_training = self.model.training
        self.model.eval()
        try:
            greedy, answers = self._rewards(0.0, None)
            gen = torch.Generator().manual_seed(derive_seed("eval", self.spec.seed, step) % 2**63)
            sampled, _ = self._rewards(self.spec.grpo.temperature, gen)
        finally:
            self.model.train(was_training)
        report = EvalReport(step=step, version=version, prompts=len(self.prompts),
                            greedy_accuracy=_accuracy(greedy), sampled_accuracy=_accuracy(sampled),
                            sampled_reward_mean=_mean(sampled), seconds=time.perf_counter() - start,
                            greedy_answers=[a[:ANSWER_CHARS] for a in answers])
        log.info("held-out accuracy at step %d: greedy %s, sampled %s (%d prompts, %.1fs)", step,
                 report.greedy_accuracy, report.sampled_accuracy, report.prompts, report.seconds)
        return report

    def _rewards(self, temperature: float, gen: torch.Generator | None) -> tuple[list[float | None], list[str]]:
        """Each prompt's reward and answer."""
        rewards: list[float | None] = []
        answers: list[str] = []
        for start in range(0, len(self.prompts), BATCH):
            batch = self.prompts[start:start + BATCH]
            ids = [encode_prompt(self.tokenizer, p.text, p.context) for p in batch]
            out = sample(self.model, ids, max_new_tokens=self.spec.grpo.max_new_tokens,
                         eos_id=self.tokenizer.eos_token_id, pad_id=self.pad_id, temperature=temperature, generator=gen)
            for p, s in zip(batch, out, strict=True):
                text = self.tokenizer.decode(s.completion_ids, skip_special_tokens=True)
                rewards.append(self._score(TaskPrompt(text=p.text, reference=p.reference), text))
                answers.append(text)
        return rewards, answers

    def _score(self, prompt: TaskPrompt, text: str) -> float | None:
        """The reward, or None (counted as wrong) when the task cannot score it: an evaluation never stops the
        learner; the training groups it could not score pause the job."""
        try:
            return self.task.reward(prompt, text, self.params)
        except Exception as exc:  # noqa: BLE001 - the task may call out (http_reward)
            log.warning("held-out answer left unscored: %s", exc)
            return None


def _accuracy(rewards: list[float | None]) -> float | None:
    """The share of prompts answered right (reward 1; an unscorable answer counts as wrong)."""
    return sum(r is not None and r >= 1.0 for r in rewards) / len(rewards) if rewards else None


def _mean(rewards: list[float | None]) -> float | None:
    scored = [r for r in rewards if r is not None]
    return sum(scored) / len(scored) if scored else None
