"""With grpo.support_replay, _Pass._loss renormalises the policy's logprobs over the sampler's top-k/top-p
support (logp - log Z) but takes the KL reference's logprobs over the whole vocabulary. The k3 term then compares
a truncated policy with an untruncated reference: on the reference model itself the KL "to the base model" is
not 0 (k3 = Z - log Z - 1 per token) and its gradient is not 0, so kl_coef pulls a policy that IS the reference
away from it (towards putting mass outside the support)."""

from __future__ import annotations

import copy

import torch
from echo2.loading import load_causal_lm

from learner.objective import ObjectiveConfig
from learner.policy import Rollouts, grpo_update, sample


def _update(tiny_dir, kl_coef: float):
    model = load_causal_lm(tiny_dir, dtype=torch.float32)
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    prompts = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 3, 7]]
    # greedy completions: every token is the argmax, inside any top-k support (none is masked)
    drawn = sample(model, prompts, max_new_tokens=4, eos_id=-1, pad_id=0, temperature=0.0)
    rows = Rollouts()
    for prompt, s, reward in zip(prompts, drawn, [1.0, 0.0, 1.0, 0.0], strict=True):
        rows.add(prompt, s.completion_ids, s.logprobs, reward, 0, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = grpo_update(model, opt, rows, ObjectiveConfig(kl_coef=kl_coef), ref_model=reference, pad_id=0,
                        support=(8, 1.0), grad_clip=None)
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return stats, grad


def test_kl_to_the_reference_vanishes_on_the_reference_with_support_replay(tiny_dir):
    stats, with_kl = _update(tiny_dir, 1.0)
    _, without_kl = _update(tiny_dir, 0.0)
    kl_grad = (with_kl - without_kl).norm() / without_kl.norm()
    assert stats["mismatch"][-1]["masked"] == 0.0 and without_kl.norm() > 0
    assert stats["kl"] < 1e-6 and kl_grad < 1e-4, (
        f"policy == reference, yet kl {stats['kl']:.3f} and the KL term moves the gradient by {float(kl_grad):.1%}")
