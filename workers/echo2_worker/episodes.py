"""Multi-turn episodes, played turn by turn with the control plane (api/services/episodes.py).

A lease of a multi-turn job (`LeaseRead.episode` set) makes each of a group's samples an episode:
the model answers, the control plane runs the environment on the model's tokens and answers with the
tokens to append (the environment's reply, framed by the model's chat template), and so on until it
says `done`. All the batch's open episodes advance together: one backend call and one request per turn. A sample is
submitted as all its turns in order, `turns` giving their lengths; the environment's tokens carry
logprob 0 and are neither trained on nor audited. The environment, its secrets and the reward stay
with the control plane, which checks the submitted tokens against the turns it saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from echo2.protocol import MIN_LOGPROB, EpisodeLimits, EpisodeStep, SampleSubmit, SamplingParams
from echo2.seeds import sample_seed

from .backends import GenerationBackend, GenRequest
from .control import ControlPlane

STEPS_PER_CALL = 4_096  # echo2.protocol.EpisodeTurns takes at most this many steps


@dataclass
class _Episode:
    prompt_id: int
    sample: int
    seed: int
    context: list[int]  # prompt, then every turn so far: what the model reads next
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    done: bool = False

    def submit(self) -> SampleSubmit:
        return SampleSubmit(token_ids=self.tokens, logprobs=self.logprobs, finish_reason=self.finish_reason,
                            turns=self.turns)


def play(backend: GenerationBackend, control: ControlPlane, lease_id: str, prompts: list[tuple[int, int, list[int]]],
         sampling: SamplingParams, limits: EpisodeLimits) -> list[list[SampleSubmit]]:
    """Play every sample of every (prompt_id, seed, prompt tokens) to its end; one list of samples per prompt."""
    episodes = [[_Episode(pid, k, sample_seed(seed, k), list(ids)) for k in range(sampling.group_size)]
                for pid, seed, ids in prompts]
    open_ = [e for group in episodes for e in group]
    for turn in range(limits.max_turns):
        if not open_:
            break
        _turn(backend, control, lease_id, open_, turn, sampling, limits)
        open_ = [e for e in open_ if not e.done]
    if open_:  # the control plane ends every episode at its last turn; this one did not
        raise RuntimeError(f"lease {lease_id}: {len(open_)} episodes still open after {limits.max_turns} turns")
    return [[e.submit() for e in group] for group in episodes]


def _turn(backend: GenerationBackend, control: ControlPlane, lease_id: str, episodes: list[_Episode], turn: int,
          sampling: SamplingParams, limits: EpisodeLimits) -> None:
    # One seed per episode; each turn draws from the position its first token has in the sample, so the
    # auditor replays every model token from (seed, position) as for a single-turn sample.
    requests = [GenRequest(prompt_token_ids=e.context, n=1, seeds=[e.seed],
                           max_new_tokens=min(sampling.max_new_tokens, limits.max_tokens - len(e.tokens)),
                           temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                           start_position=len(e.tokens))
                for e in episodes]
    actions = [sample for (sample,) in backend.generate(requests)]
    steps = [EpisodeStep(prompt_id=e.prompt_id, sample=e.sample, turn=turn, action_token_ids=a.token_ids)
             for e, a in zip(episodes, actions, strict=True)]
    per_call = min(STEPS_PER_CALL, limits.max_steps)
    replies = [reply for i in range(0, len(steps), per_call)
               for reply in control.play_turns(lease_id, steps[i : i + per_call])]
    for e, action, reply in zip(episodes, actions, replies, strict=True):
        e.tokens += action.token_ids
        e.logprobs += [max(MIN_LOGPROB, min(0.0, lp)) for lp in action.logprobs]
        e.turns.append(len(action.token_ids))
        e.finish_reason, e.done = action.finish_reason, reply.done
        if not reply.done:
            observation = reply.observation_token_ids
            e.tokens += observation
            e.logprobs += [0.0] * len(observation)
            e.turns.append(len(observation))
            e.context += action.token_ids + observation
