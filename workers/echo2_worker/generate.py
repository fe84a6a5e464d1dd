"""One batch of a lease made into the groups to submit: G samples of each prompt from the backend (with
partial rollouts, in segments that may span versions: partial.py), or G episodes played with the control
plane (episodes.py). A group carries the version of its oldest token, the lease's unless partial
rollouts moved on, and its samples are clamped to what the protocol accepts."""

from __future__ import annotations

import time
from collections.abc import Iterator

from echo2.prompting import encode_prompt
from echo2.protocol import (
    MIN_LOGPROB,
    EpisodeLimits,
    GroupSubmit,
    LeasedPrompt,
    LeaseRead,
    PromptSampling,
    SampleSubmit,
    SamplingParams,
)
from echo2.seeds import sample_seed

from . import episodes
from .backends import GenRequest, GenSample
from .control import ControlPlane
from .partial import PartialRollouts, oldest_version, runs_of
from .progress import Stats
from .versions import Versions


class Generator:
    """Generates with whatever `versions` has in its backend now (the main thread swaps between batches)."""

    def __init__(self, versions: Versions, partial: PartialRollouts, control: ControlPlane, stats: Stats) -> None:
        self.versions, self.partial, self.control, self.stats = versions, partial, control, stats

    def groups(self, prompts: list[LeasedPrompt], lease: LeaseRead) -> Iterator[list[GroupSubmit]]:
        """G samples of each prompt, as the lease's sampling asks, tagged with the version that drew them: all
        at once, or with partial rollouts, each group as soon as it is done (partial.py). Each yielded group's
        gen_seconds is its share of the time since the last yield, so they add up to the batch's."""
        backend = self.versions.backend
        assert backend is not None
        sampling = lease.sampling
        prompt_ids = [p.token_ids or encode_prompt(self.versions.tokenizer, p.text, p.context) for p in prompts]
        if lease.episode is not None:
            yield self._play(prompts, prompt_ids, lease, lease.episode)
            return
        requests = [_request(p, ids, sampling) for p, ids in zip(prompts, prompt_ids, strict=True)]
        t0 = time.monotonic()
        batches = self.partial.generate(requests) if sampling.partial_rollouts else [
            list(enumerate(backend.generate(requests)))]
        for done in batches:
            now = time.monotonic()
            seconds, t0 = now - t0, now
            self.stats.tokens.add(sum(len(s.token_ids) for _, group in done for s in group))
            yield [GroupSubmit(prompt_id=prompts[i].prompt_id, version=oldest_version(group, lease.version),
                               prompt_token_ids=prompt_ids[i], samples=[_sample(s) for s in group],
                               gen_seconds=round(seconds / len(done), 4), precision=backend.precision)
                   for i, group in done]

    def _play(self, prompts: list[LeasedPrompt], prompt_ids: list[list[int]], lease: LeaseRead,
              limits: EpisodeLimits) -> list[GroupSubmit]:
        """Multi-turn: every sample an episode, played with the control plane (episodes.py)."""
        assert self.versions.backend is not None
        t0 = time.monotonic()
        groups = episodes.play(self.versions.backend, self.control, lease.id,
                               [(p.prompt_id, p.seed, ids) for p, ids in zip(prompts, prompt_ids, strict=True)],
                               lease.sampling, limits)
        seconds = time.monotonic() - t0
        self.stats.tokens.add(sum(len(s.token_ids) for group in groups for s in group))
        return [GroupSubmit(prompt_id=p.prompt_id, version=lease.version, prompt_token_ids=ids, samples=samples,
                            gen_seconds=round(seconds / len(prompts), 4), precision=self.versions.backend.precision)
                for p, ids, samples in zip(prompts, prompt_ids, groups, strict=True)]


def _request(prompt: LeasedPrompt, ids: list[int], sampling: SamplingParams) -> GenRequest:
    """A prompt's generation: its own sampling (a Tinker request), else the lease's."""
    own = prompt.sampling or PromptSampling(n=sampling.group_size, max_tokens=sampling.max_new_tokens,
                                            temperature=sampling.temperature, top_p=sampling.top_p,
                                            top_k=sampling.top_k, stop_token_ids=None)
    return GenRequest(prompt_token_ids=ids, n=own.n, seeds=[sample_seed(prompt.seed, k) for k in range(own.n)],
                      max_new_tokens=own.max_tokens, temperature=own.temperature, top_p=own.top_p, top_k=own.top_k,
                      stop_token_ids=own.stop_token_ids or [], stop_at_eos=own.stop_token_ids is None)


def _sample(s: GenSample) -> SampleSubmit:
    return SampleSubmit(token_ids=s.token_ids, logprobs=[max(MIN_LOGPROB, min(0.0, lp)) for lp in s.logprobs],
                        text=s.text.replace("\x00", "")[:32_768], finish_reason=s.finish_reason, versions=runs_of(s))
