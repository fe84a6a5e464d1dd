"""Rewards a task accepts must be rewards the learner can train and report.

`http_reward` accepts any finite number from the user's endpoint (tasks/http_reward.py: "expects a finite number
back"). The learner trains the step on it, then builds the StepReport, whose reward fields are bounded at +-1e6
(echo2.protocol.learner: Reward, StepReport.reward_mean / reward_std). A user whose verifier answers on a larger
scale (a game score, a count of test cases times weights, 2e6) gets a pydantic ValidationError in
learner/loop.py::_report after the optimiser has already stepped: the learner process dies on every step it
trains, is relaunched, dies again; the job never committed a step and the user was told nothing about the reward
(review finding). A reward outside the bound is refused as the task's failure to score, with a reason."""

from __future__ import annotations

import httpx
import pytest
import torch
from echo2.loading import load_causal_lm
from echo2.prompting import encode_prompt
from echo2.protocol import ClaimedGroup, JobSpec, SampleSubmit

from learner.loop import _kept, _report
from learner.policy import sample
from learner.trainer import GRPOTrainer
from tasks.http_reward import HttpRewardTask


def _trainer(tiny_dir):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    spec = JobSpec.model_validate({"name": "scores", "base_model": str(tiny_dir),
                                   "task": {"name": "http_reward", "params": {"url": "http://127.0.0.1:9/score"}},
                                   "grpo": {"group_size": 4, "prompts_per_step": 1, "max_new_tokens": 6}})
    return GRPOTrainer(load_causal_lm(tiny_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(tiny_dir), spec)


def _group(trainer) -> ClaimedGroup:  # type: ignore[no-untyped-def]
    text = "Write a haiku."
    ids = encode_prompt(trainer.tokenizer, text)
    trainer.model.eval()
    out = sample(trainer.model, [ids] * 4, max_new_tokens=6, eos_id=trainer.tokenizer.eos_token_id,
                 pad_id=trainer.pad_id, seed=3)
    samples = [SampleSubmit(token_ids=s.completion_ids, logprobs=s.logprobs,
                            finish_reason="stop" if s.finished else "length") for s in out]
    return ClaimedGroup(rollout_id="rol_1", prompt_id=1, prompt_text=text, reference=None, version=0,
                        worker_id="wrk_1", prompt_token_ids=ids, samples=samples)


def test_a_reward_beyond_the_bound_is_unscored_with_its_reason_and_the_step_report_is_built(tiny_dir, monkeypatch):

    def endpoint(self, p, payload):  # type: ignore[no-untyped-def]  # the user's verifier: a score per character
        return httpx.Response(200, json={"reward": 1e6 + 1e5 * len(payload["completion"])})

    monkeypatch.setattr(HttpRewardTask, "post", endpoint)
    trainer = _trainer(tiny_dir)
    groups = [_group(trainer)]
    result = trainer.step(groups, 0)
    assert list(result.unscored) == ["rol_1"] and result.tokens == 0  # never trained on
    assert "is outside ±1e+06: scale the task's rewards into that range" in result.unscored["rol_1"]
    report = _report(0, _kept(groups, result), result)  # Learner._train's next call: it no longer raises
    assert report.rollout_ids == []


def test_a_reward_beyond_the_bound_does_not_crash_the_held_out_evaluation(tiny_dir, monkeypatch):
    """The same bound in EvalReport.sampled_reward_mean: the evaluation before the first step already dies."""
    from echo2.protocol import EvalPrompt

    from learner.evaluate import Evaluator

    monkeypatch.setattr(HttpRewardTask, "post", lambda self, p, payload: httpx.Response(200, json=2e6))
    trainer = _trainer(tiny_dir)
    held_out = [EvalPrompt(id=1, text="Write a haiku.", context=None, reference=None)]
    evaluator = Evaluator(trainer.spec, held_out, trainer.model, trainer.tokenizer, trainer.pad_id)
    report = evaluator.run(0, 0)
    assert report.sampled_reward_mean is None


def test_an_environment_ending_an_episode_beyond_the_bound_fails_the_episode_with_the_reason():
    from tasks.base import TaskError
    from tasks.http_env import _turn

    assert _turn({"done": True, "reward": 1e6}, "http://env").reward == 1e6
    with pytest.raises(TaskError, match=r"http_env http://env: reward 2e\+06 is outside ±1e\+06"):
        _turn({"done": True, "reward": 2e6}, "http://env")
