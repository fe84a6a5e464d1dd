"""Learner steps on CUDA in bf16 (skipped without a GPU). Step time is printed for BENCHMARKS.md."""

import logging
import time

import pytest
import torch
from echo2.loading import load_causal_lm

from learner.objective import ObjectiveConfig
from learner.policy import Rollouts, grpo_update

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]


def test_grpo_steps_on_cuda_in_bf16(tiny_model_dir):

    model = load_causal_lm(tiny_model_dir, use_safetensors=True).to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    rows = 64
    rollouts = Rollouts(
        prompt_ids=[[5, 6, 7]] * rows,
        completion_ids=[torch.randint(2, 90, (4,), generator=g).tolist() for _ in range(rows)],
        behaviour_logprobs=[[-4.0] * 4] * rows,
        rewards=[float(i % 2) for i in range(rows)],
        group_ids=[i // 8 for i in range(rows)],
        staleness=[i % 3 for i in range(rows)],
    )
    before = next(model.parameters()).detach().clone()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        stats = grpo_update(model, optimizer, rollouts, ObjectiveConfig(), pad_id=1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        assert stats["stepped"] == 1.0 and torch.isfinite(torch.tensor(stats["loss"]))
    assert not torch.equal(before, next(model.parameters()).detach())
    logging.getLogger(__name__).warning("cuda bf16 grpo_update: %.1f ms/step for %d samples",
                                        1000 * min(times[1:]), rows)
