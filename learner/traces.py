"""The learner's own logprob of every token it trains on, for rollout traces (GET /v1/jobs/{id}/rollouts/{r}):
beside each token's behaviour logprob (the worker's), it shows where the sampler and the trainer disagree.

Computed under the weights the step starts from, which is what the objective's importance ratio compares the
behaviour logprobs with, and in the step's compute (bf16 autocast on a GPU), in one forward pass without
gradients (about a third of a step's compute; the job's `trace_logprobs` turns it off), micro-batched like the
step itself.
"""

from __future__ import annotations

from typing import Any

import torch
from echo2.protocol import MIN_LOGPROB

from .policy import Rollouts, autocast, completion_logprobs, micro_batches, pad_batch

DIGITS = 4  # stored rounded: the trace shows them, nothing computes with them


@torch.no_grad()
def learner_logprobs(model: Any, rows: Rollouts, pad_id: int, temperature: float, max_tokens: int) -> list[list[float]]:
    """Each row's completion logprobs under `model` as it is (eval mode: no dropout), one per token."""
    lengths = [len(p) + len(c) for p, c in zip(rows.prompt_ids, rows.completion_ids, strict=True)]
    out: list[list[float]] = [[] for _ in lengths]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for chunk in micro_batches(lengths, max_tokens):
            batch = pad_batch([rows.prompt_ids[i] for i in chunk], [rows.completion_ids[i] for i in chunk],
                              pad_id).to(device)
            with autocast(device):  # the step's own compute: bf16 on a GPU
                values = completion_logprobs(model, batch, temperature=temperature).float().cpu()
            for k, i in enumerate(chunk):
                n = len(rows.completion_ids[i])
                out[i] = [round(max(MIN_LOGPROB, min(0.0, v)), DIGITS) for v in values[k, :n].tolist()]
    finally:
        model.train(was_training)
    return out
