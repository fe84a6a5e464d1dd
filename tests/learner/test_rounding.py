"""The learner computes on the weights it publishes (learner/rounding.py), on the real tiny model."""

from __future__ import annotations

import copy

import pytest
import torch

from learner.objective import ObjectiveConfig
from learner.policy import Rollouts, completion_logprobs, grpo_update, pad_batch, sample
from learner.rounding import Rounder, dithered, thresholds
from learner.weights import Weights

BF16 = torch.bfloat16


def _bf16_model(tiny):
    """The tiny model with its weights on the bf16 grid, as a bf16 base model loads into float32."""
    model = copy.deepcopy(tiny[0])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(BF16).float())
    return model


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """bf16's step at |x| (x on the grid): the value of its last mantissa bit."""
    bits = x.abs().contiguous().view(torch.int32)
    return ((bits + 0x10000).view(torch.float32) - x.abs())


def test_dithered_keeps_grid_values_and_moves_as_far_as_the_master_on_average():
    base = (torch.randn(200_000) * 0.05).to(BF16).float()
    u = thresholds(base.shape, base.device, seed=3, index=0)
    assert torch.equal(dithered(base, u), base)  # version 0 is the base, bit for bit
    for frac in (0.1, 0.3, -0.3):
        master = base + frac * _ulp(base) * base.sign()  # |master| moved by frac of a step
        published = dithered(master, u)
        assert torch.equal(published.to(BF16).float(), published)  # on the bf16 grid
        moved = (published - base) / (_ulp(base) * base.sign())
        assert set(moved.round().unique().tolist()) <= ({0.0, 1.0} if frac > 0 else {0.0, -1.0})
        assert moved.mean().item() == pytest.approx(frac, abs=0.01)  # unbiased: E[published] = master
        if frac > 0:  # (downwards, a power of two's lower neighbour is half a step away)
            assert torch.equal(master.to(BF16).float(), base)  # nearest drops every move under half a step


def test_dithered_thresholds_are_fixed_per_weight():
    a = thresholds(torch.Size([1000]), torch.device("cpu"), seed=1, index=4)
    assert torch.equal(a, thresholds(torch.Size([1000]), torch.device("cpu"), seed=1, index=4))
    assert not torch.equal(a, thresholds(torch.Size([1000]), torch.device("cpu"), seed=1, index=5))
    assert int(a.min()) >= 0 and int(a.max()) <= 0xFFFF


@pytest.mark.parametrize("dither", [False, True])
def test_computing_holds_the_published_weights_and_keeps_the_masters(tiny, dither):
    model = _bf16_model(tiny)
    rounder = Rounder(model, BF16, dithered=dither, seed=7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.full_like(p, 3e-4))  # masters off the grid
    masters = [p.detach().clone() for p in model.parameters()]
    with rounder.computing():
        inside = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(masters, model.parameters(), strict=True))
    assert all(torch.equal(p, p.to(BF16).float()) for p in inside)
    assert any(not torch.equal(a, b) for a, b in zip(masters, inside, strict=True))
    snap = Weights(model, tiny[1], BF16, rounder=rounder).snapshot()
    state = {k: v for k, v in snap.items() if v.is_floating_point()}
    assert all(v.dtype == BF16 for v in state.values())
    names = dict(model.named_parameters())
    assert all(torch.equal(state[k].float(), inside[list(names).index(k)]) for k in names)


def test_frozen_parameters_are_rounded_once(tiny):
    model = copy.deepcopy(tiny[0])  # float32 weights off the bf16 grid
    for p in model.parameters():
        p.requires_grad_(False)
    Rounder(model, BF16)
    assert all(torch.equal(p, p.to(BF16).float()) for p in model.parameters())


def _rollouts(model, tok, seed=0) -> Rollouts:
    prompts = [tok(t)["input_ids"] for t in ["3+4=", "12+7=", "5+5=", "9+1="]]
    out = sample(model, prompts, max_new_tokens=4, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, seed=seed)
    return Rollouts([list(p) for p in prompts], [s.completion_ids for s in out], [s.logprobs for s in out],
                    [1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1], [0, 0, 0, 0])


def test_the_learner_trains_the_policy_it_publishes(tiny):
    """Masters 2e-4 off the grid: the workers' version (the snapshot) is the rounded model. Its behaviour
    logprobs match the learner's exactly when the learner computes on what it publishes (mismatch KL 0),
    and do not when it computes on the masters; the optimiser still steps the float32 masters."""
    tok = tiny[1]
    model = _bf16_model(tiny)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 2e-4)
    rounder = Rounder(model, BF16)
    published = copy.deepcopy(model)
    published.load_state_dict({k: v.float() for k, v in Weights(model, tok, BF16, rounder=rounder).snapshot().items()})
    rows = _rollouts(published, tok)
    cfg = ObjectiveConfig(max_staleness=0)
    for computing, exact in ((rounder.computing, True), (None, False)):
        trained = copy.deepcopy(model)
        opt = torch.optim.SGD(trained.parameters(), lr=1e-3)
        kwargs = {"computing": Rounder(trained, BF16).computing} if computing else {}
        stats = grpo_update(trained, opt, rows, cfg, pad_id=tok.pad_token_id, **kwargs)
        whole = stats["mismatch"][-1]
        assert (whole["kl"] < 1e-12) == exact, whole
        assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), trained.parameters(), strict=True))
        assert all(p.dtype == torch.float32 for p in trained.parameters())


def test_gradients_are_taken_at_the_published_weights(tiny):
    tok = tiny[1]
    model = _bf16_model(tiny)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 2e-4)
    rounder = Rounder(model, BF16)
    rows = _rollouts(model, tok, seed=2)
    batch = pad_batch(rows.prompt_ids, rows.completion_ids, tok.pad_token_id)
    rounded = copy.deepcopy(model)
    with rounder.computing():
        rounded.load_state_dict(model.state_dict())
    completion_logprobs(rounded, batch).sum().backward()
    with rounder.computing():
        completion_logprobs(model, batch).sum().backward()
    for a, b in zip(model.parameters(), rounded.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
