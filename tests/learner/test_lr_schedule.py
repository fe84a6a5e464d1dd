"""The learning-rate schedule is documented per learner step, "from lr down to lr * min_lr_ratio at max_steps"
(echo2.protocol.jobs.LrSchedule, GRPOConfig.min_lr_ratio "Where a linear or cosine schedule ends";
learner/trainer.py::lr_factor "The learning rate at `step`"). GRPOTrainer.optimise advanced the scheduler only when
grpo_update took an optimiser step (review finding), so every step whose groups all had equal rewards (common early
on a hard task, or late once a task is solved) shifts the whole schedule: warm-up and decay run late, and a job ends
before its learning rate reaches min_lr_ratio."""

from __future__ import annotations

import pytest
import torch
from echo2.loading import load_causal_lm
from echo2.prompting import encode_prompt
from echo2.protocol import ClaimedGroup, JobSpec, SampleSubmit

from learner.policy import sample
from learner.trainer import GRPOTrainer, lr_factor
from tasks import TaskAdapter, register


class _Scored(TaskAdapter):
    """Every sample of a "same" prompt scores 1 (no signal); others score their length."""

    name = "test_lr_schedule_scored"
    description = "Test task: 1 for a \"same\" prompt, else the sample's length."

    def reward(self, prompt, completion, params):  # type: ignore[no-untyped-def]
        return 1.0 if prompt.text.startswith("same") else float(len(completion))


register(_Scored())


def _group(trainer, text: str, seed: int) -> ClaimedGroup:  # type: ignore[no-untyped-def]
    ids = encode_prompt(trainer.tokenizer, text)
    trainer.model.eval()
    out = sample(trainer.model, [ids] * 4, max_new_tokens=6, eos_id=trainer.tokenizer.eos_token_id,
                 pad_id=trainer.pad_id, seed=seed)
    samples = [SampleSubmit(token_ids=s.completion_ids, logprobs=s.logprobs,
                            finish_reason="stop" if s.finished else "length") for s in out]
    return ClaimedGroup(rollout_id=f"rol_{seed}", prompt_id=seed, prompt_text=text, reference=None, version=0,
                        worker_id="wrk_1", prompt_token_ids=ids, samples=samples)


def _linear(tiny_dir, max_steps: int) -> GRPOTrainer:  # type: ignore[no-untyped-def]
    """A trainer whose rate falls linearly from 1e-3 to 0 at `max_steps`."""
    from transformers import AutoTokenizer

    spec = JobSpec.model_validate({"name": "sched", "base_model": str(tiny_dir), "max_steps": max_steps,
                                   "task": {"name": "test_lr_schedule_scored"},
                                   "grpo": {"group_size": 4, "prompts_per_step": 1, "max_new_tokens": 6,
                                            "lr": 1e-3, "lr_schedule": "linear", "min_lr_ratio": 0.0}})
    return GRPOTrainer(load_causal_lm(tiny_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(tiny_dir), spec)


def test_the_linear_schedule_follows_the_learner_steps_when_a_step_had_no_signal(tiny_dir):
    trainer = _linear(tiny_dir, max_steps=2)
    spec = trainer.spec
    first = trainer.step([_group(trainer, "same 1+1=", 1)], 0)
    assert first.groups_dropped == 1  # all rewards equal: nothing to learn at step 0
    # Step 1 is the job's last of 2: per the schedule it trains at lr * lr_factor(1) = lr / 2.
    assert lr_factor(1, spec) == pytest.approx(0.5)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(spec.grpo.lr * lr_factor(1, spec))


def test_a_rank_told_to_optimise_step_t_trains_at_step_ts_learning_rate(tiny_dir):
    """The other ranks of a sharded learner only run `optimise` (learner/launch.py::follow): each sets the rate of
    the step it is told before its optimiser step (a first version stepped the schedule on rank 0 alone)."""
    from learner.trainer import StepResult

    follower = _linear(tiny_dir, max_steps=8)
    spec = follower.spec
    rows = follower._score([_group(follower, "1+1=", 2)], 0, StepResult())  # its groups, scored on rank 0
    follower.optimise(rows, StepResult(), 3)
    assert follower.optimizer.param_groups[0]["lr"] == pytest.approx(spec.grpo.lr * lr_factor(3, spec))
    assert lr_factor(3, spec) < 1
