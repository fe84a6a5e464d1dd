"""The learner's one sampler: `num_samples` continuations of each request's prompt, several requests batched
together with one KV cache, drawn by the replayable sampler (echo2.sampler). The Tinker host's `asample`
requests (learner/tinker/session.py) and the learner's own draws (`learner.policy.sample`: held-out
evaluation, benches, tests) both run it.

Each token's logprob is reported under the distribution it was drawn from before top-k/top-p cut it
(log-softmax of logits / temperature; at temperature 0, greedy, under temperature 1), as the
importance-sampling losses expect of a sampler; a sampled token's top-k list (`topk_sample`) is of that
same distribution. Prompt logprobs, their top-k lists (`topk_prompt`, the last `prompt_last_n` positions
only when set) are under temperature 1; the alternative prompt tokens (`alt_k`) are drawn independently,
with replacement, at the request's temperature (temperature 1 for a greedy request), from a generator seeded
by the request's seed, and carry their logprobs under that temperature. A sequence
stops at a stop token (kept) or once its text contains a stop string (the tokens that completed it kept),
else at `max_tokens` ("length").

An in-flight request (`inflight`) is drawn a segment at a time (at most `segment_tokens(max_tokens)` new
tokens, the rule of workers/echo2_worker/partial.py): the host reports what it drew as `SampleProgress`, runs
the model's next requests (a training step, an in-flight save), and draws the next segment with the newest
in-flight checkpoint. Each segment prefills the prompt and the tokens so far again under the weights of the
moment, so every token's logprob is exactly the one of the checkpoint that drew it, and it draws with the
row's own seed from the position it has reached: where no checkpoint changed, the sample is the one a single
pass draws. Every token is tagged with the checkpoint that drew it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import torch
from echo2.protocol.tinker import SampledSequence, SampleParams, SamplePayload, SampleProgress, SampleResult
from echo2.sampler import RowSettings, draw, logprobs
from echo2.seeds import sample_seed

SEGMENTS = 8  # as workers/echo2_worker/partial.py: a full-length sample is interrupted at most this often
MIN_SEGMENT_TOKENS = 16
FLOOR = -1e4  # the protocol's lowest logprob


def segment_tokens(max_tokens: int) -> int:
    return max(MIN_SEGMENT_TOKENS, -(-max_tokens // SEGMENTS))


@dataclass
class _Row:
    """One sample being drawn: what it has, and which checkpoint drew which of its tokens."""

    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    runs: list[list[Any]] = field(default_factory=list)
    topk: list[list[tuple[int, float]] | None] = field(default_factory=list)
    stopped: bool = False
    done: bool = False

    def add(self, token: int, logprob: float, checkpoint: str, topk: list[tuple[int, float]] | None) -> None:
        self.tokens.append(token)
        self.logprobs.append(min(0.0, max(logprob, FLOOR)))
        if self.runs and self.runs[-1][0] == checkpoint:
            self.runs[-1][1] += 1
        else:
            self.runs.append([checkpoint, 1])
        self.topk.append(topk)


@dataclass
class _Slice:
    """One request's rows in the batch."""

    payload: SamplePayload
    rows: list[_Row]
    live: list[int]  # indices into `rows` drawn in this call
    budget: int  # new tokens each live row may draw in this call
    stop_ids: set[int]
    seed: int


def sample(model: Any, tokenizer: Any, payloads: list[SamplePayload], eos_id: int | None,
           checkpoint: str = "", *, row_seeds: list[list[int]] | None = None,
           pad_id: int | None = None) -> list[SampleResult | SampleProgress]:
    """Several requests in one batch (left-padded prompts, one KV cache), every row drawn by the replayable
    sampler with its request's parameters, seed sample_seed(seed, k) for its k-th sample (or `row_seeds[r][k]`
    where given: the learner's evaluation seeds row i of its batch with sample_seed(seed, i)) and position = the
    token's index in its sample. `checkpoint` names the weights in place (the tag of every token drawn now).
    An in-flight request not finished after its segment comes back as its progress. `tokenizer` pads (unless
    `pad_id` is given) and reads stop strings; None where neither is needed."""
    slices = [_layout(p, eos_id, row_seeds[r] if row_seeds else None) for r, p in enumerate(payloads)]
    order = [(s, i) for s in slices for i in s.live]
    if pad_id is None:
        eos = tokenizer.eos_token_id
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    if order:
        _draw(model, tokenizer, slices, order, checkpoint, pad_id)
    return [_answer(s) for s in slices]


def _layout(payload: SamplePayload, eos_id: int | None, seeds: list[int] | None) -> _Slice:
    params, progress = payload.params, payload.progress
    stop_ids = set(params.stop_tokens) if params.stop_tokens is not None else ({eos_id} - {None})
    if progress is None:
        seed = params.seed if params.seed is not None else secrets.randbelow(2**31)
        rows = [_Row(seed=seeds[k] if seeds else sample_seed(seed, k)) for k in range(payload.num_samples)]
    else:
        seed = progress.seed
        rows = [_resumed(sample_seed(seed, k), state) for k, state in enumerate(progress.rows)]
        for row, topk in zip(rows, progress.topk or [], strict=False):
            row.topk = list(topk)
    live = [i for i, row in enumerate(rows) if not row.done]
    budget = params.max_tokens if not payload.inflight else segment_tokens(params.max_tokens)
    return _Slice(payload, rows, live, budget, stop_ids, seed)


def _resumed(seed: int, state: tuple) -> _Row:
    tokens, lps, runs, stopped, done = state
    return _Row(seed=seed, tokens=list(tokens), logprobs=list(lps), runs=[list(r) for r in runs],
                stopped=stopped, done=done)


def _draw(model: Any, tokenizer: Any, slices: list[_Slice], order: list[tuple[_Slice, int]],
          checkpoint: str, pad: int) -> None:
    device = next(model.parameters()).device
    prefixes = [s.payload.prompt + s.rows[i].tokens for s, i in order]
    width = max(len(p) for p in prefixes)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prefixes], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prefixes], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    settings = RowSettings.of([(s.payload.params.temperature, s.payload.params.top_k, s.payload.params.top_p)
                               for s, _ in order], device)
    seeds = torch.tensor([s.rows[i].seed for s, i in order], dtype=torch.int64, device=device)
    starts = torch.tensor([len(s.rows[i].tokens) for s, i in order], dtype=torch.int64, device=device)
    limits = [min(s.budget, s.payload.params.max_tokens - len(s.rows[i].tokens)) for s, i in order]
    drawn_here = [0] * len(order)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        _score_prompts(slices, order, out.logits, width, device)
        next_pos = positions[:, -1:] + 1
        for step in range(max(limits)):
            logits = out.logits[:, -1, :]
            tokens, chosen = draw(logits, settings, seeds, starts + step)
            wanted = max(s.payload.topk_sample for s, _ in order)
            top = torch.topk(logprobs(logits, settings), wanted, dim=-1) if wanted else None
            for j, (s, i) in enumerate(order):
                row = s.rows[i]
                if row.done or drawn_here[j] >= limits[j]:
                    continue
                k = s.payload.topk_sample
                ranked = None if not k or top is None else _pairs(top.indices[j, :k], top.values[j, :k])
                row.add(int(tokens[j]), float(chosen[j]), checkpoint, ranked)
                drawn_here[j] += 1
                row.stopped = row.tokens[-1] in s.stop_ids or _stopped(tokenizer, row.tokens, s.payload.params)
                row.done = row.stopped or len(row.tokens) >= s.payload.params.max_tokens
            if all(s.rows[i].done or drawn_here[j] >= limits[j] for j, (s, i) in enumerate(order)):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            out = model(input_ids=tokens.unsqueeze(-1), attention_mask=mask, position_ids=next_pos,
                        past_key_values=out.past_key_values, use_cache=True)
            next_pos = next_pos + 1


def _score_prompts(slices: list[_Slice], order: list[tuple[_Slice, int]], logits: torch.Tensor, width: int,
                   device: Any) -> None:
    """What a request asks of its prompt, from the prefill of its first row, on its first segment only."""
    first = {}
    for j, (s, _) in enumerate(order):
        first.setdefault(id(s), j)
    for s in slices:
        p = s.payload
        if p.progress is not None or not p.scores_prompt() or id(s) not in first:
            continue
        row = logits[first[id(s)], width - len(p.prompt):].float()
        s.payload = p.model_copy(update={"progress": _prompt_scores(row, p, s.seed, device)})


def _prompt_scores(logits: torch.Tensor, payload: SamplePayload, seed: int, device: Any) -> SampleProgress:
    """Prompt logprobs (temperature 1), their top-k, and alternative draws at the request's temperature, of
    every prompt position after the first (the last `prompt_last_n` of them when set)."""
    prompt = payload.prompt
    lp = torch.log_softmax(logits[:-1], -1)  # row i scores prompt token i + 1
    scored_from = 1 if payload.prompt_last_n is None else max(1, len(prompt) - payload.prompt_last_n)
    out = SampleProgress(rows=[], seed=seed)
    if payload.prompt_logprobs:
        picked = lp.gather(-1, torch.tensor(prompt[1:], device=device).unsqueeze(-1)).squeeze(-1).clamp(FLOOR, 0.0)
        out.prompt_logprobs = [None if i < scored_from else float(picked[i - 1]) for i in range(len(prompt))]
    if payload.topk_prompt:
        top = torch.topk(lp, min(payload.topk_prompt, lp.shape[-1]), dim=-1)
        out.topk_prompt = [None if i < scored_from else _pairs(top.indices[i - 1], top.values[i - 1])
                           for i in range(len(prompt))]
    if payload.alt_k and len(prompt) > 1:
        temperature = payload.params.temperature
        scaled = torch.log_softmax(logits[:-1] / temperature, -1) if temperature > 0 else lp
        generator = torch.Generator(device="cpu").manual_seed(sample_seed(seed, 2**20))
        ids = torch.multinomial(scaled.exp().cpu(), payload.alt_k, replacement=True, generator=generator)
        alt = scaled.cpu().gather(-1, ids).clamp(FLOOR, 0.0)
        out.alt = (ids.tolist(), alt.tolist())
    return out


def _pairs(ids: torch.Tensor, values: torch.Tensor) -> list[tuple[int, float]]:
    return [(int(t), min(0.0, max(float(v), FLOOR))) for t, v in zip(ids.tolist(), values.tolist(), strict=True)]


def _answer(s: _Slice) -> SampleResult | SampleProgress:
    scores = s.payload.progress
    if not all(row.done for row in s.rows):  # an in-flight request with more segments to go
        return SampleProgress(
            rows=[(r.tokens, r.logprobs, [tuple(x) for x in r.runs], r.stopped, r.done) for r in s.rows],
            seed=s.seed, prompt_logprobs=scores.prompt_logprobs if scores else None,
            topk_prompt=scores.topk_prompt if scores else None, alt=scores.alt if scores else None,
            topk=[r.topk for r in s.rows] if s.payload.topk_sample else None)
    sequences = [SampledSequence(tokens=r.tokens, logprobs=r.logprobs, stop_reason="stop" if r.stopped else "length",
                                 checkpoints=[tuple(x) for x in r.runs] or None,
                                 topk=r.topk if s.payload.topk_sample else None) for r in s.rows]
    return SampleResult(sequences=sequences, prompt_logprobs=scores.prompt_logprobs if scores else None,
                        topk_prompt=scores.topk_prompt if scores else None,
                        alt_tokens=scores.alt[0] if scores and scores.alt else None,
                        alt_logprobs=scores.alt[1] if scores and scores.alt else None)


def _stopped(tokenizer: Any, tokens: list[int], params: SampleParams) -> bool:
    if not params.stop_strings:
        return False
    text = tokenizer.decode(tokens[-64:], skip_special_tokens=False)
    return any(stop in text for stop in params.stop_strings)
