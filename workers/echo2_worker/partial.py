"""Partial rollouts (a job with `partial_rollouts` on): generate in segments and, between two segments,
load a newer version as soon as the worker holds one, continuing every unfinished sample from the tokens
it already has.

Why segments: both backends' `generate` is one synchronous call, so a generation can be interrupted
only where a call returns. A segment is at most `segment_tokens(max_new_tokens)` new tokens; the next
one continues with the prompt plus the tokens so far as its prompt. That prompt is prefilled again under
the weights loaded now: a KV cache computed with the old weights would give logprobs of no version at
all, whereas this way each token's behaviour logprob is exactly base.py's definition under the version
that drew it, which is what the learner's ratio and the auditor recompute. Every token is tagged with
that version (SampleSubmit.versions, runs oldest first); a group's version is its oldest token's, which
bounds its staleness (api/services/admission.py): a swap never makes a group look fresher than it is.
Segments are also where finished groups leave: each is submitted as soon as all its samples are done, so
the short groups of a batch are not held back (and made stale) by a long one beside them.

Every segment draws with the sample's own seed from the position it has reached (GenRequest.start_position),
so a sample is the one non-partial generation draws wherever no version changed, and the auditor replays
each token under its own version with the same (seed, position).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from echo2.protocol import Assignment

from .backends import GenerationBackend, GenRequest, GenSample
from .backends.base import BackendError, FinishReason
from .versions import Versions

SEGMENTS = 8  # a full-length sample is interrupted at most this often: each interruption re-prefills it
MIN_SEGMENT_TOKENS = 16


def segment_tokens(max_new_tokens: int) -> int:
    """New tokens per segment for a job's max_new_tokens."""
    return max(MIN_SEGMENT_TOKENS, -(-max_new_tokens // SEGMENTS))


@dataclass(frozen=True)
class VersionedSample(GenSample):
    """A sample whose tokens may come from several versions: [version, count] runs, oldest first."""

    versions: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _Draft:
    """One sample being generated: what it has so far, and which version drew each stretch of it."""

    request: GenRequest
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    runs: list[list[int]] = field(default_factory=list)
    finish: FinishReason | None = None

    def extend(self, out: GenSample, version: int) -> None:
        self.tokens += out.token_ids
        self.logprobs += out.logprobs
        if self.runs and self.runs[-1][0] == version:
            self.runs[-1][1] += len(out.token_ids)
        else:
            self.runs.append([version, len(out.token_ids)])
        if out.finish_reason == "stop":
            self.finish = "stop"
        elif len(self.tokens) >= self.request.max_new_tokens:
            self.finish = "length"

    def next_segment(self, size: int) -> GenRequest:
        r = self.request
        return replace(r, prompt_token_ids=r.prompt_token_ids + self.tokens, n=1, seeds=[self.seed],
                       max_new_tokens=min(size, r.max_new_tokens - len(self.tokens)),
                       start_position=r.start_position + len(self.tokens))

    def sample(self, decode: Callable[[list[int]], str]) -> VersionedSample:
        assert self.finish is not None
        return VersionedSample(token_ids=self.tokens, logprobs=self.logprobs, finish_reason=self.finish,
                               text=decode(self.tokens), versions=[(v, n) for v, n in self.runs])


class PartialRollouts:
    """The segment driver. `assignment` gives the latest heartbeat's assignment (the version to hold),
    `parents` its relay parents for a download this starts."""

    def __init__(self, versions: Versions, assignment: Callable[[], Assignment | None],
                 parents: Callable[[Assignment], list[str]]) -> None:
        self.versions, self._assignment, self._parents = versions, assignment, parents

    def refresh(self) -> int:
        """Load the assigned version when it is newer than the loaded one and on disk (else start fetching
        it); returns the version loaded now. Within the loaded job only: a move to another job waits for
        the lease to end, as without partial rollouts."""
        loaded = self.versions.loaded
        assert loaded is not None
        a = self._assignment()
        if a is not None and a.job_id == loaded[0] and a.version > loaded[1]:
            self.versions.hold(a, lambda: self._parents(a))
        if self.versions.loaded is None:  # the swap failed and unloaded (Versions._load_failed): the lease goes back
            raise BackendError("the newer version failed to load mid-lease")
        return self.versions.loaded[1]

    def generate(self, requests: list[GenRequest]) -> Iterator[list[tuple[int, list[VersionedSample]]]]:
        """After each segment, the requests whose samples have all finished in it: (index in `requests`, its n
        samples in seed order, as GenerationBackend.generate), version-tagged. A request is yielded as soon as
        it is done, not when the batch is: a short group batched with a long one would otherwise wait for it,
        and be stale when it is submitted."""
        size = segment_tokens(max(r.max_new_tokens for r in requests))
        groups = [[_Draft(r, seed) for seed in r.seeds] for r in requests]
        first = [replace(r, max_new_tokens=min(size, r.max_new_tokens)) for r in requests]
        version = self.refresh()
        for drafts, outs in zip(groups, self._backend().generate(first), strict=True):
            for draft, out in zip(drafts, outs, strict=True):
                draft.extend(out, version)
        pending = set(range(len(requests)))
        while pending:
            if done := sorted(i for i in pending if all(d.finish is not None for d in groups[i])):
                pending -= set(done)
                yield [(i, self._samples(groups[i])) for i in done]
            if unfinished := [d for i in sorted(pending) for d in groups[i] if d.finish is None]:
                version = self.refresh()
                outs = self._backend().generate([d.next_segment(size) for d in unfinished])
                for draft, (out,) in zip(unfinished, outs, strict=True):
                    draft.extend(out, version)

    def _samples(self, drafts: list[_Draft]) -> list[VersionedSample]:
        tokenizer = self.versions.tokenizer
        return [d.sample(lambda t: tokenizer.decode(t, skip_special_tokens=True)) for d in drafts]

    def _backend(self) -> GenerationBackend:
        assert self.versions.backend is not None
        return self.versions.backend


def oldest_version(samples: list[GenSample], default: int) -> int:
    """A group's version: its oldest token's; `default` (the lease's) for samples not made here."""
    return min((s.versions[0][0] for s in samples if isinstance(s, VersionedSample)), default=default)


def runs_of(sample: GenSample) -> list[tuple[int, int]] | None:
    """SampleSubmit.versions of a sample: its runs when made here, else None (every token the group's)."""
    return sample.versions if isinstance(sample, VersionedSample) else None
