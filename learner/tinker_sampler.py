"""Sampling for Tinker `asample` requests: `num_samples` continuations of each request's prompt, several
requests batched together with one KV cache, drawn by the replayable sampler (echo2.sampler).

Each token's logprob is reported under the distribution it was drawn from before top-k/top-p cut it
(log-softmax of logits / temperature; at temperature 0, greedy, under temperature 1), as the
importance-sampling losses expect of a sampler. A sequence stops at a stop token (kept) or once its
text contains a stop string (the tokens that completed it kept), else at `max_tokens` ("length").
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import torch
from echo2.protocol.tinker import SampledSequence, SampleParams, SamplePayload, SampleResult
from echo2.sampler import RowSettings, draw
from echo2.seeds import sample_seed


@dataclass
class _Slice:
    """One request's rows in the batch: its num_samples copies of its prompt."""

    payload: SamplePayload
    rows: range
    stop_ids: set[int]


def sample(model: Any, tokenizer: Any, payloads: list[SamplePayload], eos_id: int | None) -> list[SampleResult]:
    """Several requests in one batch (left-padded prompts, one KV cache), every row drawn by the replayable
    sampler (echo2.sampler) with its request's parameters and seed sample_seed(seed, k) for its k-th sample."""
    slices, prompts = _layout(payloads, eos_id)
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_id or 0)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    settings, seeds = _row_settings(slices, device)
    rows: list[list[int]] = [[] for _ in prompts]
    logps: list[list[float]] = [[] for _ in prompts]
    stopped, done = [False] * len(prompts), [False] * len(prompts)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        prompt_logprobs = [_prompt_logprobs(out.logits[s.rows[0], width - len(s.payload.prompt):], s.payload.prompt)
                           if s.payload.prompt_logprobs else None for s in slices]
        next_pos = positions[:, -1:] + 1
        for step in range(max(p.params.max_tokens for p in payloads)):
            drawn, chosen = draw(out.logits[:, -1, :], settings, seeds, torch.full_like(seeds, step))
            for s in slices:
                for i in s.rows:
                    if not done[i]:
                        rows[i].append(int(drawn[i]))
                        logps[i].append(min(0.0, max(float(chosen[i]), -1e4)))
                        stopped[i] = rows[i][-1] in s.stop_ids or _stopped(tokenizer, rows[i], s.payload.params)
                        done[i] = stopped[i] or len(rows[i]) >= s.payload.params.max_tokens
            if all(done):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            out = model(input_ids=drawn.unsqueeze(-1), attention_mask=mask, position_ids=next_pos,
                        past_key_values=out.past_key_values, use_cache=True)
            next_pos = next_pos + 1
    return [SampleResult(sequences=[SampledSequence(tokens=rows[i], logprobs=logps[i],
                                                    stop_reason="stop" if stopped[i] else "length") for i in s.rows],
                         prompt_logprobs=lps) for s, lps in zip(slices, prompt_logprobs, strict=True)]


def _layout(payloads: list[SamplePayload], eos_id: int | None) -> tuple[list[_Slice], list[list[int]]]:
    slices, prompts = [], []
    for payload in payloads:
        params = payload.params
        stop_ids = set(params.stop_tokens) if params.stop_tokens is not None else ({eos_id} - {None})
        rows = range(len(prompts), len(prompts) + payload.num_samples)
        slices.append(_Slice(payload, rows, stop_ids))
        prompts.extend([payload.prompt] * payload.num_samples)
    return slices, prompts


def _row_settings(slices: list[_Slice], device: Any) -> tuple[RowSettings, torch.Tensor]:
    """Each row's sampling settings and seed: sample_seed(the request's seed, k) for its k-th sample; a request
    without a seed gets a random one."""
    settings, seeds = [], []
    for s in slices:
        p = s.payload.params
        seed = p.seed if p.seed is not None else secrets.randbelow(2**31)
        settings += [(p.temperature, p.top_k, p.top_p)] * len(s.rows)
        seeds += [sample_seed(seed, k) for k in range(len(s.rows))]
    return RowSettings.of(settings, device), torch.tensor(seeds, dtype=torch.int64, device=device)


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
