"""Multi-turn episodes, played through the control plane so the environment stays on the trusted side.

A multi-turn task (TaskAdapter.multi_turn) makes every sample of a group an episode. The worker sends
each model turn as tokens; this module decodes them with the job's tokenizer, runs the task's
environment and answers with the environment's reply as tokens (framed as a user turn by the
model's chat template, when it has one) plus `done`. The environment's secrets (the reference, the
hidden number) and the reward never leave the platform: the reward is stored on the episode and
becomes the rollout's at submission (admission.py checks the submitted tokens against the episode).

Environments are rebuilt from the prompt and replayed over the actions so far at every turn, so the
control plane keeps no live objects and any API process can serve any turn; a task's Episode must
therefore be a deterministic function of its prompt and the actions (tasks/base.py).
An environment that raises or times out (a user-hosted one, say) ends the episode with no reward and
the reason stored: its group is refused as the platform's fault, never the worker's, and the
learner never waits on it. No database transaction waits on an environment: a request's steps are
checked, the transaction ends, the environments run, and a second transaction stores their replies
(on SQLite one transaction holds the only connection, so an environment taking its time would have
stalled every other request). A request carries at most `EpisodeLimits.max_steps` steps: the ones the
environment can answer within the request's deadline at its concurrency. A worker that falls silent
mid-episode loses its lease at its TTL, and the prompt goes back to the pool like any other.
While its environments play, a request holds one of the API process's request threads (anyio's 40): at most
IN_FLIGHT of them play at once in a process, PER_WORKER for one worker, and a request past those is answered 429
with Retry-After at once, so slow environments (or a worker sending many requests) never take the threads every
other route needs.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

from echo2.protocol import EpisodeLimits, EpisodeReply, EpisodeStep, GroupSubmit, JobSpec, LeaseStatus
from sqlalchemy import delete, select, tuple_
from sqlalchemy.orm import Session

from tasks import TaskAdapter, TaskError, TaskParams, TaskPrompt, get_task

from ..db import insert_skipping_conflicts
from ..errors import ApiError
from ..models import Episode, Job, Lease, Prompt, utcnow
from ..storage import BlobStore
from . import modelinfo
from .jobs import spec_of

log = logging.getLogger(__name__)
MAX_EPISODE_TOKENS = 16_384  # a submitted sample's token limit (echo2.protocol.SampleSubmit)
ENV_DEADLINE_S = 60.0  # one request's environment calls; a worker's client waits longer (echo2_worker.control)
MAX_OBSERVATION_TOKENS = 512  # one environment reply; a longer one ends its episode as the environment's failure
MAX_STEPS = 4_096  # echo2.protocol.EpisodeTurns
IN_FLIGHT = 16  # episode requests playing at once in one API process: under half its 40 request threads
PER_WORKER = 2  # an honest worker sends one a round; a second covers a retry racing its first attempt
RETRY_AFTER_S = 1
_playing: Counter[str] = Counter()  # worker id -> its requests playing in this process
_playing_lock = threading.Lock()


@contextmanager
def playing_slot(worker_id: str) -> Iterator[None]:
    """Hold one of the process's episode slots while a request plays, or refuse it (429, Retry-After) at once."""
    with _playing_lock:
        busy = None
        if _playing[worker_id] >= PER_WORKER:
            busy = (f"worker {worker_id} has {PER_WORKER} episode requests playing already: send a lease's turns "
                    "one request a round, and retry this one when an earlier one has answered")
        elif sum(_playing.values()) >= IN_FLIGHT:
            busy = (f"this API process is playing {IN_FLIGHT} episode requests already, its most at once (so that "
                    "environments never hold the threads other routes need): retry shortly")
        if busy:
            raise ApiError(429, busy, headers={"Retry-After": str(RETRY_AFTER_S)})
        _playing[worker_id] += 1
    try:
        yield
    finally:
        with _playing_lock:
            _playing[worker_id] -= 1
            if not _playing[worker_id]:
                del _playing[worker_id]


def limits(job: Job) -> EpisodeLimits | None:
    """The episode bounds of a multi-turn job; None for a single-turn one (and a Tinker fleet job, taskless)."""
    if not job.kind.has_task:
        return None
    spec = spec_of(job)
    task = get_task(spec.task.name)
    if not task.multi_turn:
        return None
    params = task.parse_params(spec.task.params)
    turns = task.max_turns(params)
    room = turns * spec.grpo.max_new_tokens + (turns - 1) * MAX_OBSERVATION_TOKENS
    step_s = task.step_seconds(params)
    rounds = MAX_STEPS if step_s <= 0 else max(1, int(ENV_DEADLINE_S // step_s))
    return EpisodeLimits(max_turns=turns, max_tokens=min(MAX_EPISODE_TOKENS, room),
                         max_steps=min(MAX_STEPS, task.concurrency(params) * rounds))


@dataclass
class _Game:
    """What every turn of one request needs, looked up once: the job's spec, task, bounds and tokenizer."""

    db: Session
    job: Job
    spec: JobSpec
    task: TaskAdapter
    params: TaskParams
    bounds: EpisodeLimits
    decode: Callable[[list[int]], str]


def play(db: Session, blobs: BlobStore, lease: Lease, job: Job, steps: list[EpisodeStep]) -> list[EpisodeReply]:
    """Model turns of the lease's episodes: check them all and end the transaction, run the environments
    (up to the task's concurrency at once, within ENV_DEADLINE_S) holding no connection, then store and
    answer their replies in a new transaction (the caller commits it). A bad step refuses the whole
    request before anything of it is stored."""
    bounds = limits(job)
    if bounds is None:
        raise ApiError(409, f"job {job.id}'s task is single-turn: generate and submit whole completions")
    if lease.status != LeaseStatus.active or lease.expires_at < utcnow():
        raise ApiError(409, f"lease {lease.id} is no longer active; its episodes are over")
    if len(steps) > bounds.max_steps:
        raise ApiError(422, f"{len(steps)} steps in one request, but this job's environment answers at most "
                            f"{bounds.max_steps} within a request's deadline (EpisodeLimits.max_steps): send them "
                            "in several requests", field="steps")
    spec = spec_of(job)
    task = get_task(spec.task.name)
    game = _Game(db, job, spec, task, task.parse_params(spec.task.params), bounds,
                 modelinfo.decoder(blobs, job.id))
    _refuse_repeats(steps)
    known = _episodes(db, lease, steps)
    moves = [_move(game, lease, step, i, known) for i, step in enumerate(steps)]
    fresh = [(i, episode, step) for i, (episode, step, new) in enumerate(moves) if new]
    texts = [game.decode(step.action_token_ids) for _, _, step in fresh]
    prompts = _prompts(db, {step.prompt_id for _, _, step in fresh})
    db.commit()  # nothing was written: this ends the transaction, and its hold on the database
    # The first turn of a job renders its chat template, in a child process that may take seconds.
    encode = modelinfo.observation_encoder(blobs, job.id) if fresh else None
    outcomes = _run_environments(game, [(prompts[e.prompt_id], [*e.actions, text])
                                        for (_, e, _), text in zip(fresh, texts, strict=True)])
    played = _store(game, lease, list(zip(fresh, texts, outcomes, strict=True)), encode)
    return [_reply(game, played.get(i, episode), step.turn) for i, (episode, step, _) in enumerate(moves)]


def _store(game: _Game, lease: Lease, played: list[tuple[tuple[int, Episode, EpisodeStep], str, _Outcome]],
           encode: Callable[[str, bool], list[int]] | None) -> dict[int, Episode]:
    """The played turns, stored on their episodes' rows, all locked now by one query in one order (two requests
    storing the same episodes cannot deadlock); if another request played a turn in the meantime (a retry racing
    its first attempt), its answer stands when the tokens are the same. By step index."""
    if not played:
        return {}
    steps = [step for (_, _, step), _, _ in played]
    firsts = [{"lease_id": lease.id, "prompt_id": step.prompt_id, "sample": step.sample, "job_id": game.job.id,
               "actions": [], "turns": [], "done": False} for step in steps if step.turn == 0]
    if firsts:  # new episodes' rows, unless a twin inserted them
        game.db.execute(insert_skipping_conflicts(game.db, Episode), firsts)
    rows = _episodes(game.db, lease, steps, lock=True)
    out = {}
    for (i, _, step), text, outcome in played:
        episode = rows.get((step.prompt_id, step.sample))
        if episode is None:  # its lease ended and its episodes were dropped meanwhile
            raise ApiError(409, f"lease {lease.id} is no longer active; its episodes are over")
        if step.turn < len(episode.actions):
            _check_retry(episode, step, f"steps.{i}")
        else:
            assert encode is not None
            _advance(game, episode, step.action_token_ids, text, outcome, encode)
        out[i] = episode
    return out


def _episodes(db: Session, lease: Lease, steps: list[EpisodeStep],
              lock: bool = False) -> dict[tuple[int, int], Episode]:
    """The stored episodes the steps name, by (prompt id, sample), in one query (locked: in that order, read anew)."""
    query = select(Episode).where(Episode.lease_id == lease.id, tuple_(Episode.prompt_id, Episode.sample).in_(
        [(step.prompt_id, step.sample) for step in steps]))
    if lock:
        query = (query.order_by(Episode.prompt_id, Episode.sample).with_for_update()
                 .execution_options(populate_existing=True))
    return {(e.prompt_id, e.sample): e for e in db.scalars(query)}


def _move(game: _Game, lease: Lease, step: EpisodeStep, i: int,
          known: dict[tuple[int, int], Episode]) -> tuple[Episode, EpisodeStep, bool]:
    """The step's episode as stored (`known`; a new one, not stored, for a first turn), and whether the step is
    a new turn (False: a retry of an answered one)."""
    where = f"steps.{i}"
    episode = _episode(game, lease, step, where, known)
    if step.turn < len(episode.actions):
        _check_retry(episode, step, where)
        return episode, step, False
    if step.turn > len(episode.actions):
        raise ApiError(409, f"{where}: turn {step.turn} comes after turn {len(episode.actions)}, which was never "
                            "played", field=f"{where}.turn")
    if episode.done:
        raise ApiError(409, f"{where}: episode {step.prompt_id}/{step.sample} is over after "
                            f"{len(episode.actions)} turns", field=f"{where}.turn")
    _check_action(game, episode, step.action_token_ids, where)
    return episode, step, True


def _refuse_repeats(steps: list[EpisodeStep]) -> None:
    seen: set[tuple[int, int]] = set()
    for i, step in enumerate(steps):
        if (step.prompt_id, step.sample) in seen:
            raise ApiError(422, f"steps.{i}: episode {step.prompt_id}/{step.sample} appears twice; send one turn "
                                "of an episode per request", field=f"steps.{i}")
        seen.add((step.prompt_id, step.sample))


def _episode(game: _Game, lease: Lease, step: EpisodeStep, where: str,
             known: dict[tuple[int, int], Episode]) -> Episode:
    if step.prompt_id not in set(lease.prompt_ids):
        raise ApiError(404, f"{where}: prompt {step.prompt_id} is not part of lease {lease.id}",
                       field=f"{where}.prompt_id")
    if step.sample >= game.spec.grpo.group_size:
        raise ApiError(422, f"{where}: sample {step.sample} is outside the group (group size "
                            f"{game.spec.grpo.group_size})", field=f"{where}.sample")
    episode = known.get((step.prompt_id, step.sample))
    if episode is None:  # its first turn: _store inserts it
        return Episode(lease_id=lease.id, prompt_id=step.prompt_id, sample=step.sample, job_id=game.job.id,
                       actions=[], turns=[], done=False)
    return episode


def _check_retry(episode: Episode, step: EpisodeStep, where: str) -> None:
    """A retried turn (the answer was lost on the way) is answered again, if it is the same action."""
    if episode.turns[2 * step.turn] != list(step.action_token_ids):
        raise ApiError(409, f"{where}: turn {step.turn} of this episode was already played with other tokens",
                       field=f"{where}.turn")


def _check_action(game: _Game, episode: Episode, ids: list[int], where: str) -> None:
    field, max_new, vocab = f"{where}.action_token_ids", game.spec.grpo.max_new_tokens, game.job.vocab_size
    if len(ids) > max_new:
        raise ApiError(422, f"{where}: {len(ids)} tokens in one turn, but the job's max_new_tokens is {max_new}",
                       field=field)
    if vocab is not None and max(ids) >= vocab:
        raise ApiError(422, f"{where}: token id {max(ids)} is outside the vocabulary (size {vocab})", field=field)
    used = sum(map(len, episode.turns))
    if used + len(ids) > game.bounds.max_tokens:
        raise ApiError(422, f"{where}: the episode would hold {used + len(ids)} tokens, more than its "
                            f"{game.bounds.max_tokens}", field=field)
    room = cut_short(game.job, max_new, game.bounds, used, ids)
    if room is not None and game.job.context_length is None:
        raise ApiError(422, f"{where}: the turn ended after {len(ids)} token{'s' if len(ids) > 1 else ''} without a "
                            f"stop token, short of its {room} (max_new_tokens, or the episode's room left)",
                       field=field)


def cut_short(job: Job, max_new: int, bounds: EpisodeLimits, used: int, ids: list[int]) -> int | None:
    """The turn's limit (max_new_tokens, or the episode's room after `used` tokens) where a model turn ends short of
    it without a stop token, else None. A sampler stops there only where the model's context ends, which the turn
    then fills: such a turn ends its episode, and the group is refused when it arrives unless prompt and turns fill
    the context exactly (admission._cut_short): a worker that cut every turn after one token was paid as honest
    work."""
    stops, room = set(job.eos_token_ids or ()), min(max_new, bounds.max_tokens - used)
    return room if stops and ids[-1] not in stops and len(ids) < room else None


@dataclass(frozen=True)
class _Outcome:
    observation: str | None
    done: bool
    reward: float | None
    error: str | None = None


def _prompts(db: Session, ids: set[int]) -> dict[int, TaskPrompt]:
    return {p.id: TaskPrompt(text=p.text, reference=p.reference)
            for p in db.scalars(select(Prompt).where(Prompt.id.in_(ids)))}


def _run_environments(game: _Game, episodes: list[tuple[TaskPrompt, list[str]]]) -> list[_Outcome]:
    """Each (prompt, actions so far) through a fresh environment, `concurrency` at once. Past the
    deadline the request answers without the stragglers (their episodes end as failed); their threads
    finish on their own (an HTTP environment's every try has its own deadline)."""
    if not episodes:
        return []
    pool = ThreadPoolExecutor(max(1, min(game.task.concurrency(game.params), len(episodes))))
    futures = [pool.submit(_environment, game.task, game.params, prompt, actions) for prompt, actions in episodes]
    finished, _ = wait(futures, timeout=ENV_DEADLINE_S)
    pool.shutdown(wait=False, cancel_futures=True)
    late = _Outcome(None, True, None, f"the environment did not answer within {ENV_DEADLINE_S:.0f} s")
    return [f.result() if f in finished else late for f in futures]


def _environment(task: TaskAdapter, params: TaskParams, prompt: TaskPrompt, actions: list[str]) -> _Outcome:
    """Rebuild the environment, bring it to the last turn, play the new action."""
    try:
        env = task.new_episode(prompt, params)
        assert env is not None  # limits() checked the task is multi-turn
        env.reset()
        env.resume(actions[:-1])
        turn = env.step(actions[-1])
    except (TaskError, OSError, ValueError) as exc:
        return _Outcome(None, True, None, f"the environment failed at turn {len(actions) - 1}: {exc}")
    return _Outcome(turn.observation, turn.done, turn.reward)


def _advance(game: _Game, episode: Episode, ids: list[int], text: str, outcome: _Outcome,
             encode: Callable[[str, bool], list[int]]) -> None:
    actions, turns = [*episode.actions, text], [*episode.turns, list(ids)]
    observation, done, reward, error = outcome.observation, outcome.done, outcome.reward, outcome.error
    cut = cut_short(game.job, game.spec.grpo.max_new_tokens, game.bounds, sum(map(len, episode.turns)), ids)
    if not done and (len(actions) >= game.bounds.max_turns or cut is not None):
        done, reward = True, 0.0  # out of turns (or of the model's context) without finishing: a failure
    if not done:
        obs_ids = encode(observation or "", ids[-1] in (game.job.eos_token_ids or ()))
        if len(obs_ids) > MAX_OBSERVATION_TOKENS:
            error, done = (f"the environment's reply at turn {len(actions) - 1} has {len(obs_ids)} tokens, more than "
                           f"{MAX_OBSERVATION_TOKENS}"), True
        elif sum(map(len, turns)) + len(obs_ids) + 1 > game.bounds.max_tokens:
            done, reward = True, 0.0  # no room left for another model turn
        else:
            turns.append(obs_ids)
    if error:
        log.warning("job %s: episode %s/%d: %s", game.job.id, episode.prompt_id, episode.sample, error)
        episode.error, reward = error[:512], None
    episode.actions, episode.turns, episode.done, episode.updated_at = actions, turns, done, utcnow()
    episode.reward = reward if done else None


def _reply(game: _Game, episode: Episode, turn: int) -> EpisodeReply:
    """Turn `turn`'s answer: the observation issued after it, or done when it was the last."""
    if 2 * turn + 1 >= len(episode.turns):
        return EpisodeReply(turn=turn, done=True, observation_token_ids=[], observation="")
    observation = episode.turns[2 * turn + 1]
    return EpisodeReply(turn=turn, done=False, observation_token_ids=observation, observation=game.decode(observation))


def check_group(db: Session, lease: Lease, group: GroupSubmit) -> tuple[str | None, list[float | None]]:
    """(why the group does not match its episodes, or None; each sample's reward). The environment's
    failure is returned as the reason with an `environment:` prefix: it is not the worker's fault."""
    rows = {e.sample: e for e in db.scalars(select(Episode).where(Episode.lease_id == lease.id,
                                                                  Episode.prompt_id == group.prompt_id))}
    rewards: list[float | None] = []
    for k, sample in enumerate(group.samples):
        episode = rows.get(k)
        problem = _mismatch(episode, sample.token_ids, sample.turns)
        if problem:
            return f"sample {k}: {problem}", []
        assert episode is not None
        if episode.error:
            return f"environment: sample {k}: {episode.error}", []
        rewards.append(episode.reward)
    return None, rewards


def _mismatch(episode: Episode | None, token_ids: list[int], turns: list[int] | None) -> str | None:
    if episode is None:
        return "no episode was played for it (play each turn through POST /v1/leases/{id}/episodes)"
    if not episode.done:
        return f"its episode is not over after {len(episode.actions)} turns"
    played = [len(t) for t in episode.turns]
    if turns != played:
        return f"turns {turns} differ from the episode's {played}"
    if token_ids != [i for t in episode.turns for i in t]:
        return "its tokens differ from the turns played in its episode"
    return None


def drop_ended(db: Session, before: datetime) -> int:
    """Delete the episodes of leases that ended, last played before `before`; returns how many. Nothing reads
    them again: a group of an ended lease is refused before its episodes are looked at, and a submitted
    group's turns are in its rollout (retries are answered from the rollout)."""
    ended = select(Lease.id).where(Lease.status != LeaseStatus.active)
    gone = db.execute(delete(Episode).where(Episode.updated_at <= before, Episode.lease_id.in_(ended))
                      .execution_options(synchronize_session=False)).rowcount
    db.commit()
    return gone
