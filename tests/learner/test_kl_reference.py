"""The KL reference is "version 0 as published" (loop.py: `Rounder(reference, dtype)`, nearest rounding),
but with bf16 versions and the default `weights.rounding` (auto -> dithered in a single process) the policy the
learner computes on, and publishes as version 0, is the DITHERED rounding of the masters. For a base whose
weights are not on the bf16 grid (a float32 checkpoint such as echo2:tiny, with weights.dtype bfloat16), the
reference is not version 0: the KL penalty at step 0 is not 0 and pulls the policy towards another model."""

from __future__ import annotations

import torch
from echo2.loading import load_causal_lm
from echo2.protocol import JobSpec

from learner.loop import _as_version_0, _reference, _versions
from learner.objective import ObjectiveConfig
from learner.parallel import Solo
from learner.policy import Rollouts, completion_logprobs, grpo_update, pad_batch
from learner.rounding import Rounder
from learner.trainer import GRPOTrainer


def test_kl_to_the_reference_is_zero_on_version_0(tiny_dir):
    from transformers import AutoTokenizer

    spec = JobSpec.model_validate({"name": "t", "base_model": str(tiny_dir), "task": {"name": "arithmetic"},
                                   "grpo": {"kl_coef": 0.1}, "weights": {"dtype": "bfloat16"}})
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = load_causal_lm(tiny_dir, dtype=torch.float32)
    reference = _reference(model, spec)
    Rounder(reference, torch.bfloat16)  # as loop.build does, to the end
    weights = _versions(model, tok, spec, str(tiny_dir), torch.bfloat16, Solo())
    trainer = GRPOTrainer(model, tok, spec, reference, Solo())
    trainer.weights = weights
    _as_version_0(reference, trainer)
    rows = Rollouts()
    for i, reward in enumerate([1.0, 0.0, 1.0, 0.0]):
        rows.add([1, 2, 3, 4], [5 + i, 6, 7 + i, 8, 9], [-1.0] * 5, reward, 0, 0)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    stats = grpo_update(model, opt, rows, ObjectiveConfig(kl_coef=0.1), ref_model=reference, pad_id=0,
                        computing=weights.computing)
    with torch.no_grad(), weights.computing():
        batch = pad_batch([[1, 2, 3, 4]] * 4, [[5 + i, 6, 7 + i, 8, 9] for i in range(4)], 0)
        gap = (completion_logprobs(model, batch) - completion_logprobs(reference, batch)).abs().max()
        same = sum(int((p == q).sum()) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
        total = sum(p.numel() for p in model.parameters())
    # with weights.rounding "nearest" both are nearest(base) and the KL is exactly 0
    assert stats["kl"] == 0.0, (
        f"KL to the reference on version 0 itself: {stats['kl']:.2e}; logprobs differ by up to {float(gap):.2e}; "
        f"{total - same} of {total} weights of version 0 differ from the reference's")
