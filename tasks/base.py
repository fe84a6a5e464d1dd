"""The task-adapter interface: where prompts come from and how a completion is scored.

A task adapter is the data plane of a job. The control plane uses it (without torch) to validate
the job's task params and to generate or read prompts; the learner uses it to compute rewards on
the trusted side. Adding a task = one new module with a `TaskAdapter` subclass + `register(...)`.

Contract of `reward`: a float (1.0 / 0.0 for verifiable tasks); `ScoringError` naming why when the
completion could not be scored (a remote verifier down, timing out or answering nonsense); None when
there is nothing to score it against. A group with a sample the learner could not score is never trained:
it goes back to the pool as the platform's fault, and a job whose groups keep failing pauses, saying why
(JobSpec.reward_failures_to_pause).

Multi-turn tasks additionally return an `Episode` from `new_episode`: the generator alternates
model turns (`action`) and environment replies (`observation`) until the episode is done; the
episode's final reward replaces `reward`. Single-turn tasks leave `new_episode` returning None.
Workers play episodes through the control plane (api/services/episodes.py), which rebuilds the
Episode from its prompt and replays the earlier actions at every turn: an Episode must be a
deterministic function of its prompt and the actions it was given.
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from echo2.protocol.common import reason
from echo2.protocol.learner import REWARD_BOUND
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

log = logging.getLogger(__name__)
MAX_PROMPT_CHARS = 100_000
MAX_PROMPTS_PER_CALL = 1_000_000


class TaskError(ValueError):
    """A task could not be used as asked; the message says what to change."""


class TaskParamsError(TaskError):
    """Task params failed validation; `errors` lists (field, message) pairs."""

    def __init__(self, task: str, errors: list[tuple[str, str]]):
        self.task = task
        self.errors = errors
        details = "; ".join(f"{loc}: {msg}" for loc, msg in errors)
        super().__init__(f"invalid params for task {task!r}: {details}")


class ScoringError(TaskError):
    """A completion could not be scored: the message says why (an endpoint down, a timeout, a bad reply)."""


class TaskItemError(TaskError):
    """A dataset item does not fit the task (e.g. a missing key)."""


class TaskPrompt(BaseModel):
    """One prompt as the workers see it, plus what the verifier needs (never sent to workers)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    reference: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)


class TaskParams(BaseModel):
    """Base of every adapter's `Params`: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Turn:
    """The environment's answer to one model turn."""

    observation: str | None  # the next user message; None when done
    done: bool
    reward: float | None = None  # final reward, set when done


class Episode(ABC):
    """A multi-turn environment for one prompt. Stateful; one instance per sampled episode."""

    max_turns: int = 4

    @abstractmethod
    def reset(self) -> str:
        """The first user message."""

    @abstractmethod
    def step(self, action: str) -> Turn:
        """Consume the model's reply to the last observation."""

    def resume(self, actions: list[str]) -> None:
        """Bring a fresh (reset) episode to where these earlier actions left it. By replaying them; an
        environment that keeps its state elsewhere (an HTTP one) may just remember them."""
        for action in actions:
            self.step(action)


@dataclass
class EpisodeResult:
    transcript: list[tuple[str, str]] = field(default_factory=list)  # ("user" | "assistant", text)
    reward: float | None = None


def run_episode(episode: Episode, respond: Callable[[list[tuple[str, str]]], str]) -> EpisodeResult:
    """Drive an episode: `respond(transcript)` returns the model's next reply."""
    result = EpisodeResult(transcript=[("user", episode.reset())])
    for turn_index in range(episode.max_turns):
        action = respond(result.transcript)
        result.transcript.append(("assistant", action))
        turn = episode.step(action)
        if turn.done:
            result.reward = turn.reward
            return result
        if turn.observation is not None and turn_index + 1 < episode.max_turns:
            result.transcript.append(("user", turn.observation))
    result.reward = 0.0  # out of turns without finishing: a failure, not an unscored sample
    return result


class TaskAdapter(ABC):
    """Base class of every task. Subclasses set `name`, `Params`, `needs_dataset` and `reward`."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    Params: ClassVar[type[TaskParams]] = TaskParams
    needs_dataset: ClassVar[bool] = False
    # The reference is what the model must find out, and the prompt does not give it away (a hidden number).
    # Such a task's prompts are generated from a seed drawn for the job, not from the job's seed: workers
    # can work the job's seed out of their leases' sample seeds, and then replay generate_prompts.
    secret_references: ClassVar[bool] = False

    def parse_params(self, raw: Mapping[str, Any] | TaskParams | None = None) -> TaskParams:
        """Validate user-supplied params; raises TaskParamsError naming each bad field."""
        if isinstance(raw, self.Params):
            return raw
        try:
            return self.Params.model_validate(dict(raw or {}))
        except ValidationError as exc:
            errors = [(".".join(str(p) for p in e["loc"]) or "params", self._reason(e)) for e in exc.errors()]
            raise TaskParamsError(self.name, errors) from None

    def _reason(self, error: ErrorDetails) -> str:
        if error["type"] == "extra_forbidden":  # a typo, most often: say what the task takes
            return f"task {self.name} has no such parameter; it takes {', '.join(self.Params.model_fields) or 'none'}"
        return reason(error)

    def generate_prompts(self, params: TaskParams, seed: int, count: int) -> list[TaskPrompt]:
        """Synthetic tasks: `count` prompts, a pure function of (params, seed)."""
        raise TaskError(f"task {self.name!r} reads its prompts from a dataset: give dataset_id or prompts")

    def prompt_from_item(self, item: Mapping[str, Any], params: TaskParams) -> TaskPrompt:
        """Dataset tasks: one prompt from one JSONL item."""
        raise TaskError(f"task {self.name!r} generates its own prompts: leave out dataset_id and prompts (the CLI's "
                        "--dataset)")

    def prompt_key(self, params: TaskParams) -> str | None:
        """The item key a dataset task reads its prompt's text from (`prompt_key`, or `question_key` in its
        params); a chat item's last user turn is given to it under this key."""
        for name in ("prompt_key", "question_key"):
            value = getattr(params, name, None)
            if isinstance(value, str):
                return value
        return None

    def eval_prompts(self, params: TaskParams, seed: int, count: int) -> list[TaskPrompt]:
        """Synthetic tasks: up to `count` held-out prompts that `generate_prompts` never returns (disjoint
        by construction). None of them by default: a task without such a split has no held-out evaluation
        of its own (a dataset task holds out some of its items instead)."""
        return []

    @abstractmethod
    def reward(self, prompt: TaskPrompt, completion: str, params: TaskParams) -> float | None:
        """Score one completion; ScoringError (or None) when it cannot be scored."""

    def reward_or_why(self, prompt: TaskPrompt, completion: str, params: TaskParams) -> float | None | str:
        """`reward`, or why there is none (a str): what the learner calls, since a completion is a worker's
        text and a task may call out (http_reward), and neither may stop the learner. A task that raises
        anything but ScoringError is logged with its traceback: that is the task's bug."""
        try:
            return bounded_reward(self.reward(prompt, completion, params))
        except ScoringError as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - see above
            log.exception("the %s task raised while scoring", self.name)
            return f"the {self.name} task raised {type(exc).__name__}: {exc}"

    def new_episode(self, prompt: TaskPrompt, params: TaskParams) -> Episode | None:
        """Multi-turn tasks return a fresh Episode; single-turn tasks return None."""
        return None

    def concurrency(self, params: TaskParams) -> int:
        """How many rewards or environment turns of this task may be computed at once (HTTP tasks: more)."""
        return int(getattr(params, "concurrency", 1))

    def step_seconds(self, params: TaskParams) -> float:
        """The longest one environment turn takes when the environment is well (HTTP tasks: a try's timeout);
        0 for an environment computed in process. It sizes the episode requests (EpisodeLimits.max_steps)."""
        return float(getattr(params, "timeout_s", 0.0))

    def max_turns(self, params: TaskParams) -> int:
        """A multi-turn task's model turns per episode: its params' `max_turns`, else Episode.max_turns."""
        return int(getattr(params, "max_turns", Episode.max_turns))

    @property
    def multi_turn(self) -> bool:
        return type(self).new_episode is not TaskAdapter.new_episode


def require_key(item: Mapping[str, Any], key: str, task: str) -> str:
    """item[key] as a non-empty string, or a TaskItemError naming the key and the keys present."""
    if key not in item:
        present = ", ".join(sorted(map(str, item))[:20]) or "none"
        raise TaskItemError(f"task {task!r}: dataset item is missing key {key!r} (keys present: {present})")
    value = item[key]
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise TaskItemError(f"task {task!r}: item key {key!r} must be a non-empty string")
    return value


def derive_seed(*parts: object) -> int:
    """A 63-bit seed that is a pure function of its parts, e.g. (job_id, step, prompt_index)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def check_count(count: int) -> None:
    if not 0 <= count <= MAX_PROMPTS_PER_CALL:
        raise TaskError(f"count must be between 0 and {MAX_PROMPTS_PER_CALL}, got {count}")


def bounded_reward(value: float | None) -> float | None:
    """`value`, or the ScoringError that says why it cannot be used: the learner reports rewards and their means
    within ±REWARD_BOUND (a verifier answering 2e6 trained the step and then crashed its report, at every launch)."""
    if value is not None and not -REWARD_BOUND <= value <= REWARD_BOUND:
        raise ScoringError(f"reward {value:g} is outside ±{REWARD_BOUND:g}: scale the task's rewards into that range")
    return value
