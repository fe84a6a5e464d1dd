"""The Tinker losses of learner/tinker/losses.py against values and gradients worked out by hand (in the comments),
from each paper's formula as the module docstring states it."""

from __future__ import annotations

import math

import pytest
import torch
from echo2.protocol.tinker import LossFn

from learner.tinker.losses import BEHAVIOUR, datum_loss

LN2 = math.log(2)


def run(loss: str, p: list[float], config: dict[str, float] | None = None, **inputs: list[float]):
    """The loss, its gradient with respect to p (the trained logprobs), and its metrics."""
    logprobs = torch.tensor(p, dtype=torch.float64, requires_grad=True)
    tensors = {name: torch.tensor(values, dtype=torch.float64) for name, values in inputs.items()}
    value, metrics = datum_loss(LossFn(loss), logprobs, tensors, config or {})
    value.backward()
    assert logprobs.grad is not None
    return float(value.detach()), logprobs.grad.tolist(), metrics


def test_cispo_weights_the_score_by_the_clipped_ratio_without_its_gradient():
    # p = log(.5, .25), q = log(.25, .5): r = (2, .5), clipped to (1.2, .8); A = (1, 1).
    # L = -(1.2 * log .5 + .8 * log .25) = 1.2 ln2 + 1.6 ln2 = 2.8 ln2; dL/dp = -(1.2, .8).
    loss, grad, metrics = run("cispo", [math.log(0.5), math.log(0.25)], logprobs=[math.log(0.25), math.log(0.5)],
                              advantages=[1.0, 1.0])
    assert loss == pytest.approx(2.8 * LN2)
    assert grad == pytest.approx([-1.2, -0.8])
    assert metrics["clipped:sum"] == 2


def test_dro_is_the_score_less_a_quadratic_penalty_on_the_log_ratio():
    # p - q = (ln2, -ln2), beta = .5: L = -(p.A - .25 * 2 ln2^2) with A = (1, 1), p.A = -3 ln2
    # = 3 ln2 + .5 ln2^2; dL/dp_t = -(A_t - beta (p_t - q_t)) = -(1 - .5 ln2, 1 + .5 ln2).
    loss, grad, _ = run("dro", [math.log(0.5), math.log(0.25)], {"beta": 0.5},
                        logprobs=[math.log(0.25), math.log(0.5)], advantages=[1.0, 1.0])
    assert loss == pytest.approx(3 * LN2 + 0.5 * LN2**2)
    assert grad == pytest.approx([-(1 - 0.5 * LN2), -(1 + 0.5 * LN2)])
    # A prompt position (A = 0, q = 0 as an RL datum has it) is not trained: no penalty, no gradient.
    loss, grad, _ = run("dro", [math.log(0.5), math.log(0.25)], {"beta": 0.5}, logprobs=[0.0, math.log(0.5)],
                        advantages=[0.0, 1.0])
    assert loss == pytest.approx(2 * LN2 + 0.25 * LN2**2)  # -(log .25 - .25 * ln2^2)
    assert grad == pytest.approx([0.0, -(1 + 0.5 * LN2)])


def test_gspo_clips_the_length_normalised_sequence_ratio():
    # Both tokens twice as likely as sampled: s = exp((ln2 + ln2) / 2) = 2. With A = (1, 1) each token's term is
    # min(2, clip(2) = 1.0004) = 1.0004, clipped, so no gradient: L = -(1/2)(2 * 1.0004).
    p, q = [math.log(0.5)] * 2, [math.log(0.25)] * 2
    loss, grad, metrics = run("gspo", p, logprobs=q, advantages=[1.0, 1.0])
    assert loss == pytest.approx(-1.0004)
    assert grad == pytest.approx([0.0, 0.0])
    assert metrics["clipped:sum"] == 1
    # With A = (-1, -1): min(-2, -1.0004) = -2, not clipped: L = -(1/2)(-4) = 2, dL/dp_t = -(1/2) s A_t = 1.
    loss, grad, _ = run("gspo", p, logprobs=q, advantages=[-1.0, -1.0])
    assert loss == pytest.approx(2.0)
    assert grad == pytest.approx([1.0, 1.0])


def test_gspo_takes_the_sequence_over_its_mask():
    # Only the second token is in the sequence, and its log ratio is 0: s = 1, L = -A_2 = -3, dL/dp = (0, -1).
    loss, grad, _ = run("gspo", [math.log(0.5), math.log(0.5)], logprobs=[math.log(0.25), math.log(0.5)],
                        advantages=[5.0, 3.0], sequence_ratio_mask=[0.0, 1.0])
    assert loss == pytest.approx(-3.0)
    assert grad == pytest.approx([0.0, -3.0])


def test_stable_reinforce_truncates_the_ratio_to_the_recorded_behaviour():
    # b = log(.25, .5), p = log(.75, .25): rho = (3, .5), truncated at C = 2 to (2, .5); A = (1, -2).
    # L = -(2 * 1 * log .75 + .5 * -2 * log .25) = -2 log .75 - log 4; dL/dp = -(2 * 1, .5 * -2) = (-2, 1).
    # The client's `logprobs` (here wildly off) play no part.
    loss, grad, metrics = run("stable_reinforce", [math.log(0.75), math.log(0.25)], advantages=[1.0, -2.0],
                              logprobs=[-9.0, -9.0], **{BEHAVIOUR: [math.log(0.25), math.log(0.5)]})
    assert loss == pytest.approx(-2 * math.log(0.75) - math.log(4))
    assert grad == pytest.approx([-2.0, 1.0])
    assert metrics["truncated:sum"] == 1
    # A larger truncation keeps the full ratio: the weights are (3, .5).
    _, grad, metrics = run("stable_reinforce", [math.log(0.75), math.log(0.25)], {"truncation": 4.0},
                           advantages=[1.0, -2.0], **{BEHAVIOUR: [math.log(0.25), math.log(0.5)]})
    assert grad == pytest.approx([-3.0, 1.0])
    assert metrics["truncated:sum"] == 0


def test_the_ppo_and_importance_sampling_sums_are_unchanged():
    # r = (2, .5), A = (1, -1): importance_sampling L = -(2 - .5) = -1.5; ppo min(2, 1.2) + min(-.5, -.8)
    # = 1.2 - .8 = .4, so L = -.4.
    p, q = [math.log(0.5), math.log(0.25)], [math.log(0.25), math.log(0.5)]
    assert run("importance_sampling", p, logprobs=q, advantages=[1.0, -1.0])[0] == pytest.approx(-1.5)
    assert run("ppo", p, logprobs=q, advantages=[1.0, -1.0])[0] == pytest.approx(-0.4)
