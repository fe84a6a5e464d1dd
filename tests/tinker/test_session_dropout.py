"""A base model given by folder whose config carries dropout
(facebook/opt-125m: "dropout": 0.1; any Qwen2/Llama folder with attention_dropout > 0). The learner host ran
forward_backward with the model in train mode, so dropout was on (review finding): the logprobs it returned and
trained on were not the model's, and differed from `forward`'s and the sampler's for the same weights; on policy,
importance_sampling's ratio was not 1 (docs/TINKER.md: "ratio 1 on every completion token"), PPO clipped tokens
that did not move. It scores with the model as it samples now, no dropout."""

from __future__ import annotations

import json
import shutil

import pytest
from echo2.protocol.tinker import ForwardBackwardPayload, ModelSpec, SamplePayload, TinkerLora

from learner.tinker.session import TinkerSession

DATUM = {"tokens": [5, 6, 7, 8, 9, 10], "target_tokens": [6, 7, 8, 9, 10, 11], "inputs": {}}


@pytest.fixture(scope="module")
def dropout_session(tiny_model_dir, tmp_path_factory) -> TinkerSession:
    folder = tmp_path_factory.mktemp("dropout") / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["attention_dropout"] = 0.3
    (folder / "config.json").write_text(json.dumps(config))
    spec = ModelSpec(base_model=str(folder), lora=TinkerLora(rank=4, seed=0))
    return TinkerSession(spec, tmp_path_factory.mktemp("cache"), "cpu")


def test_forward_backward_scores_with_the_weights_forward_and_the_sampler_use(dropout_session):
    session = dropout_session
    forward = session.forward_backward(ForwardBackwardPayload(loss_fn="cross_entropy", data=[DATUM],
                                                              forward_only=True)).outputs[0]["logprobs"]
    trained = session.forward_backward(ForwardBackwardPayload(loss_fn="cross_entropy",
                                                              data=[DATUM])).outputs[0]["logprobs"]
    sampled = session.sample([SamplePayload(prompt=DATUM["tokens"] + [11], num_samples=1, prompt_logprobs=True,
                                            params={"max_tokens": 1, "temperature": 1.0, "seed": 0})])[0]
    assert sampled.prompt_logprobs[1:] == pytest.approx(forward, abs=1e-5)  # forward and the sampler agree
    assert trained == pytest.approx(forward, abs=1e-5), "forward_backward scored a dropout-thinned model"


def test_importance_sampling_on_policy_is_minus_the_advantages(dropout_session):
    """The sampler's own logprobs as q: ratio 1, loss -sum(A) (here -6)."""
    session = dropout_session
    q = session.forward_backward(ForwardBackwardPayload(loss_fn="cross_entropy", data=[DATUM],
                                                        forward_only=True)).outputs[0]["logprobs"]
    datum = {**DATUM, "inputs": {"logprobs": q, "advantages": [1.0] * 6}}
    result = session.forward_backward(ForwardBackwardPayload(loss_fn="importance_sampling", data=[datum]))
    assert result.metrics["loss:sum"] == pytest.approx(-6.0, abs=1e-4)
