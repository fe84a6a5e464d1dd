"""Traces.py says the learner's trace logprobs are "computed under the weights the step starts from,
which is what the objective's importance ratio compares the behaviour logprobs with". The objective computes on
the masters rounded to the published dtype (Weights.computing, learner/rounding.py), but GRPOTrainer._trace
calls learner_logprobs on the raw float32 masters: with bf16 versions the trace shows a policy that neither the
workers nor the objective use."""

from __future__ import annotations

import torch
from echo2.loading import load_causal_lm
from echo2.prompting import encode_prompt
from echo2.protocol import ClaimedGroup, JobSpec, SampleSubmit

from learner.policy import sample
from learner.rounding import Rounder
from learner.traces import learner_logprobs
from learner.trainer import GRPOTrainer, StepResult
from learner.weights import Weights


def test_trace_logprobs_are_on_the_published_weights_the_objective_uses(tiny_dir):
    from transformers import AutoTokenizer

    spec = JobSpec.model_validate({"name": "t", "base_model": str(tiny_dir), "task": {"name": "arithmetic"},
                                   "grpo": {"group_size": 4, "prompts_per_step": 1, "max_new_tokens": 6,
                                            "lr": 1e-9}, "trace_logprobs": True})
    model = load_causal_lm(tiny_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    trainer = GRPOTrainer(model, tok, spec)
    trainer.weights = Weights(model, tok, torch.bfloat16, rounder=Rounder(model, torch.bfloat16))
    text = "What is 2 + 2?"
    ids = encode_prompt(tok, text)
    model.eval()
    with trainer.weights.computing():  # the worker samples the published (bf16) version
        out = sample(model, [ids] * 4, max_new_tokens=6, eos_id=tok.eos_token_id, pad_id=trainer.pad_id, seed=3)
    samples = [SampleSubmit(token_ids=s.completion_ids, logprobs=s.logprobs,
                            finish_reason="stop" if s.finished else "length") for s in out]
    group = ClaimedGroup(rollout_id="rol_1", prompt_id=1, prompt_text=text, reference="4", version=0,
                         worker_id="wrk_1", prompt_token_ids=ids, samples=samples, audit=False)
    # what the objective's ratio is computed from: the published weights, before the step
    rows = trainer._score([group], 0, StepResult())
    with trainer.weights.computing():
        published = learner_logprobs(model, rows, trainer.pad_id, 1.0, 16384)
    masters = learner_logprobs(model, rows, trainer.pad_id, 1.0, 16384)
    result = trainer.step([group], 0)
    traced = result.learner_logprobs["rol_1"]

    def gap(a, b):
        return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))

    # the trace is stored to 4 digits: 5e-5 is its own rounding
    assert gap(traced, published) <= 1e-4, (
        f"the trace is {gap(traced, published):.4f} nats from the logprobs on the published weights the objective "
        f"uses, {gap(traced, masters):.5f} from the float32 masters'")
