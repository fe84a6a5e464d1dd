"""Sampling for Tinker `asample` requests: `num_samples` continuations of each request's prompt, several
requests batched together with one KV cache.

Each token's logprob is reported under the distribution it was drawn from before top-k/top-p cut it
(log-softmax of logits / temperature; at temperature 0, greedy, under temperature 1), as the
importance-sampling losses expect of a sampler. A sequence stops at a stop token (kept) or once its
text contains a stop string (the tokens that completed it kept), else at `max_tokens` ("length").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from echo2.protocol.tinker import SampledSequence, SampleParams, SamplePayload, SampleResult


@dataclass
class _Slice:
    """One request's rows in the batch: its num_samples copies of its prompt."""

    payload: SamplePayload
    rows: range
    generator: torch.Generator
    stop_ids: set[int]


def sample(model: Any, tokenizer: Any, payloads: list[SamplePayload], eos_id: int | None) -> list[SampleResult]:
    """Several requests in one batch (left-padded prompts, one KV cache), each drawn with its own parameters
    and its own seeded generator."""
    slices, prompts = _layout(payloads, eos_id)
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_id or 0)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    rows: list[list[int]] = [[] for _ in prompts]
    logps: list[list[float]] = [[] for _ in prompts]
    stopped, done = [False] * len(prompts), [False] * len(prompts)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        prompt_logprobs = [_prompt_logprobs(out.logits[s.rows[0], width - len(s.payload.prompt):], s.payload.prompt)
                           if s.payload.prompt_logprobs else None for s in slices]
        next_pos = positions[:, -1:] + 1
        for _ in range(max(p.params.max_tokens for p in payloads)):
            tokens = torch.full((len(prompts),), pad, dtype=torch.long)
            logits = out.logits[:, -1, :].float().cpu()
            for s in slices:
                drawn, chosen = _draw(logits[s.rows.start:s.rows.stop], s.payload.params, s.generator)
                tokens[s.rows.start:s.rows.stop] = drawn
                for i, token, logprob in zip(s.rows, drawn.tolist(), chosen.tolist(), strict=True):
                    if not done[i]:
                        rows[i].append(token)
                        logps[i].append(min(0.0, max(logprob, -1e4)))
                        stopped[i] = token in s.stop_ids or _stopped(tokenizer, rows[i], s.payload.params)
                        done[i] = stopped[i] or len(rows[i]) >= s.payload.params.max_tokens
            if all(done):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            out = model(input_ids=tokens.unsqueeze(-1).to(device), attention_mask=mask, position_ids=next_pos,
                        past_key_values=out.past_key_values, use_cache=True)
            next_pos = next_pos + 1
    return [SampleResult(sequences=[SampledSequence(tokens=rows[i], logprobs=logps[i],
                                                    stop_reason="stop" if stopped[i] else "length") for i in s.rows],
                         prompt_logprobs=lps) for s, lps in zip(slices, prompt_logprobs, strict=True)]


def _layout(payloads: list[SamplePayload], eos_id: int | None) -> tuple[list[_Slice], list[list[int]]]:
    slices, prompts = [], []
    for payload in payloads:
        params = payload.params
        seed = params.seed if params.seed is not None else int(torch.seed())
        stop_ids = set(params.stop_tokens) if params.stop_tokens is not None else ({eos_id} - {None})
        rows = range(len(prompts), len(prompts) + payload.num_samples)
        slices.append(_Slice(payload, rows, torch.Generator().manual_seed(seed), stop_ids))
        prompts.extend([payload.prompt] * payload.num_samples)
    return slices, prompts


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
