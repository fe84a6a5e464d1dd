"""Sampling for a Tinker `asample`: `num_samples` continuations of one prompt, batched with a KV cache.

Each token's logprob is reported under the distribution it was drawn from before top-k/top-p cut it
(log-softmax of logits / temperature; at temperature 0, greedy, under temperature 1), as the
importance-sampling losses expect of a sampler. A sequence stops at a stop token (kept) or once its
text contains a stop string (the tokens that completed it kept), else at `max_tokens` ("length").
"""

from __future__ import annotations

from typing import Any

import torch
from echo2.protocol.tinker import SampledSequence, SampleParams, SamplePayload, SampleResult


def sample(model: Any, tokenizer: Any, payload: SamplePayload, eos_id: int | None) -> SampleResult:
    params = payload.params
    generator = torch.Generator().manual_seed(params.seed if params.seed is not None else int(torch.seed()))
    stop_ids = set(params.stop_tokens) if params.stop_tokens is not None else ({eos_id} - {None})
    device = next(model.parameters()).device
    ids = torch.tensor([payload.prompt] * payload.num_samples, device=device)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        prompt_logprobs = _prompt_logprobs(out.logits[0], payload.prompt) if payload.prompt_logprobs else None
        rows: list[list[int]] = [[] for _ in range(payload.num_samples)]
        logps: list[list[float]] = [[] for _ in range(payload.num_samples)]
        done = [False] * payload.num_samples
        for _ in range(params.max_tokens):
            tokens, chosen = _draw(out.logits[:, -1, :].float(), params, generator)
            for i in range(payload.num_samples):
                if not done[i]:
                    rows[i].append(int(tokens[i]))
                    logps[i].append(float(chosen[i]))
                    done[i] = rows[i][-1] in stop_ids or _stopped(tokenizer, rows[i], params)
            if all(done):
                break
            out = model(input_ids=tokens.unsqueeze(-1).to(device), past_key_values=out.past_key_values, use_cache=True)
    sequences = [SampledSequence(tokens=r, logprobs=[min(0.0, max(lp, -1e4)) for lp in lp_row],
                                 stop_reason="stop" if finished else "length")
                 for r, lp_row, finished in zip(rows, logps, done, strict=True)]
    return SampleResult(sequences=sequences, prompt_logprobs=prompt_logprobs)


def _draw(logits: torch.Tensor, params: SampleParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob under the untruncated distribution at this temperature."""
    logits = logits.cpu()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    logprobs = torch.log_softmax(logits / params.temperature, -1)
    masked = logprobs.clone()
    if params.top_k > 0:
        kth = masked.topk(min(params.top_k, masked.shape[-1]), dim=-1).values[:, -1:]
        masked[masked < kth] = float("-inf")
    if params.top_p < 1:
        order = masked.argsort(-1, descending=True)
        sorted_probs = masked.gather(-1, order).exp()
        beyond = sorted_probs.cumsum(-1) - sorted_probs > params.top_p  # keep the smallest set reaching top_p
        masked.scatter_(-1, order, masked.gather(-1, order).masked_fill(beyond, float("-inf")))
    tokens = torch.multinomial(masked.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _stopped(tokenizer: Any, tokens: list[int], params: SampleParams) -> bool:
    if not params.stop_strings:
        return False
    text = tokenizer.decode(tokens[-64:], skip_special_tokens=False)
    return any(stop in text for stop in params.stop_strings)


def _prompt_logprobs(logits: torch.Tensor, prompt: list[int]) -> list[float | None]:
    logprobs = torch.log_softmax(logits.float(), -1)
    targets = torch.tensor(prompt[1:], device=logits.device)
    scored = logprobs[:-1].gather(-1, targets.unsqueeze(-1)).squeeze(-1).clamp(-1e4, 0.0)
    return [None, *scored.tolist()]
