"""A multi-turn sample's completion mask has the environment's tokens at 0 in the middle, and
PaddedBatch.select (every micro-batch of grpo_update goes through it) trims the completion columns to the
largest mask SUM instead of the largest completion LENGTH: the last model turn is cut off."""

from __future__ import annotations

import torch
from echo2.loading import load_causal_lm

from learner.objective import ObjectiveConfig
from learner.policy import Rollouts, grpo_update, pad_batch


def test_select_keeps_every_model_token_of_a_multi_turn_row():
    # model 2 tokens, environment 3 tokens, model 2 tokens: 4 trained tokens over 7 columns
    mask = [True, True, False, False, False, True, True]
    batch = pad_batch([[1, 2]], [[5, 6, 7, 8, 9, 10, 11]], 0, [mask])
    assert batch.completion_mask.sum() == 4
    mb = batch.select([0])
    assert mb.completion_mask.sum() == 4, (
        f"select kept {mb.completion_mask.tolist()} of {batch.completion_mask.tolist()}: the last model turn is lost")


def test_grpo_update_trains_every_model_token_of_a_multi_turn_group(tiny_dir):
    model = load_causal_lm(tiny_dir, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rows = Rollouts()
    turns = [2, 3, 2]  # model, environment, model
    mask = [k % 2 == 0 for k, n in enumerate(turns) for _ in range(n)]
    for i, reward in enumerate([1.0, 0.0]):
        completion = [5 + i, 6, 7, 8, 9, 10, 11 + i]
        rows.add([1, 2, 3], completion, [-1.0] * 7, reward, 0, 0, mask)
    stats = grpo_update(model, opt, rows, ObjectiveConfig(), pad_id=0)
    assert stats["tokens"] == 2 * sum(mask), f"trained {stats['tokens']} tokens, the model produced {2 * sum(mask)}"
