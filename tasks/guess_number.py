"""`guess_number`: a small multi-turn task, the reference implementation of `Episode`.

The environment holds a secret integer; each model turn is a guess, each environment turn replies
"higher", "lower" or ends the episode. Reward 1.0 when the secret is found within `max_turns` model
turns, else 0.0. Scored as a single turn (`reward`), the completion's final answer must be the secret.
"""

from __future__ import annotations

import random

from pydantic import Field, model_validator

from tasks.answers import extract_final_answer, parse_number
from tasks.base import Episode, TaskAdapter, TaskParams, TaskPrompt, Turn, check_count
from tasks.registry import register


class GuessNumberParams(TaskParams):
    low: int = Field(default=1, ge=-1_000_000, le=1_000_000)
    high: int = Field(default=20, ge=-1_000_000, le=1_000_000)
    max_turns: int = Field(default=5, ge=1, le=32)

    @model_validator(mode="after")
    def _check(self) -> GuessNumberParams:
        if self.high <= self.low:
            raise ValueError("high must be > low")
        return self


class GuessNumberEpisode(Episode):
    def __init__(self, prompt: TaskPrompt, max_turns: int):
        self.prompt = prompt
        self.secret = int(prompt.reference or 0)
        self.max_turns = max_turns
        self.turns = 0

    def reset(self) -> str:
        return self.prompt.text

    def step(self, action: str) -> Turn:
        self.turns += 1
        guess = parse_number(extract_final_answer(action))
        if guess is not None and guess == self.secret:
            return Turn(observation=None, done=True, reward=1.0)
        if self.turns >= self.max_turns:
            return Turn(observation=None, done=True, reward=0.0)
        if guess is None:
            return Turn(observation="say a number.\n", done=False)
        return Turn(observation="higher.\n" if guess < self.secret else "lower.\n", done=False)


class GuessNumberTask(TaskAdapter):
    name = "guess_number"
    description = "Multi-turn: find a secret number from higher/lower hints."
    Params = GuessNumberParams
    needs_dataset = False
    secret_references = True

    def generate_prompts(self, params: TaskParams, seed: int, count: int) -> list[TaskPrompt]:
        p = self.parse_params(params)
        assert isinstance(p, GuessNumberParams)
        check_count(count)
        rng = random.Random(seed)
        text = f"guess my number between {p.low} and {p.high}.\n"
        return [TaskPrompt(text=text, reference=str(rng.randint(p.low, p.high))) for _ in range(count)]

    def reward(self, prompt: TaskPrompt, completion: str, params: TaskParams) -> float | None:
        guess = parse_number(extract_final_answer(completion))
        return 1.0 if guess is not None and guess == parse_number(prompt.reference) else 0.0

    def new_episode(self, prompt: TaskPrompt, params: TaskParams) -> Episode:
        p = self.parse_params(params)
        assert isinstance(p, GuessNumberParams)
        return GuessNumberEpisode(prompt, p.max_turns)


register(GuessNumberTask())
