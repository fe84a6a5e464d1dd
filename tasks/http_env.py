"""`http_env`: a multi-turn environment the user hosts behind an HTTP endpoint.

At every model turn the control plane POSTs JSON {"prompt", "reference", "actions"} to `url` —
`actions` being the model's turns so far, the newest last — and expects
{"observation": "...", "done": false} to go on, or {"done": true, "reward": 0.7} to end the episode
(a finite reward). The environment is stateless as far as Echo2 is concerned: everything it needs is
in the request, so any API process can serve any turn, and a retried turn asks again. Transport
errors, timeouts, 429 and 5xx are retried `max_retries` times with backoff (Retry-After honoured,
capped); then, or on any other failure or a malformed reply, the episode ends as the
environment's failure (api/services/episodes.py): its group is refused as the platform's fault,
never the worker's, with the reason in the rollout. Up to `concurrency` turns are in flight at once.
Prompts come from user JSONL items {"prompt": ..., "reference": ...} (reference optional); the
reference never leaves the platform except to this URL.

The requests are made from the control plane. With ECHO2_ENV=production a job is refused unless the
URL resolves to public addresses (api/services/jobs.py); deployments should still restrict its egress,
as a name may resolve elsewhere later.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from tasks.base import Episode, ScoringError, TaskError, TaskParams, TaskPrompt, Turn, bounded_reward
from tasks.http_reward import GaveUp, HttpRewardParams, HttpRewardTask, ReplyTooLarge
from tasks.registry import register


class HttpEnvParams(HttpRewardParams):
    max_turns: int = Field(default=4, ge=1, le=32, description="Model turns per episode.")


class HttpEpisode(Episode):
    def __init__(self, task: HttpEnvTask, prompt: TaskPrompt, params: HttpEnvParams):
        self.task, self.prompt, self.params = task, prompt, params
        self.max_turns = params.max_turns
        self.actions: list[str] = []

    def reset(self) -> str:
        return self.prompt.text

    def resume(self, actions: list[str]) -> None:
        self.actions = list(actions)  # the endpoint gets them all with the next action: nothing to replay

    def step(self, action: str) -> Turn:
        self.actions.append(action)
        payload = {"prompt": self.prompt.text, "reference": self.prompt.reference, "actions": self.actions}
        return _turn(self.task.call(self.params, payload), self.params.url)


def _turn(body: Any, url: str) -> Turn:
    if not isinstance(body, Mapping) or not isinstance(body.get("done"), bool):
        raise TaskError(f"http_env {url}: the reply must be a JSON object with a boolean `done`")
    if body["done"]:
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise TaskError(f"http_env {url}: a reply with done=true needs a finite number `reward`")
        try:
            return Turn(observation=None, done=True, reward=bounded_reward(float(reward)))
        except ScoringError as exc:
            raise TaskError(f"http_env {url}: {exc}") from None
    observation = body.get("observation")
    if not isinstance(observation, str):
        raise TaskError(f"http_env {url}: a reply with done=false needs a string `observation`")
    return Turn(observation=observation, done=False)


class HttpEnvTask(HttpRewardTask):
    name = "http_env"
    description = "Multi-turn: an environment hosted by the user over HTTP (POST prompt/reference/actions)."
    Params = HttpEnvParams
    needs_dataset = True

    def reward(self, prompt: TaskPrompt, completion: str, params: TaskParams) -> float | None:
        raise TaskError("http_env scores whole episodes: its rewards come from the environment, turn by turn")

    def new_episode(self, prompt: TaskPrompt, params: TaskParams) -> Episode:
        p = self.parse_params(params)
        assert isinstance(p, HttpEnvParams)
        return HttpEpisode(self, prompt, p)

    def call(self, p: HttpEnvParams, payload: dict[str, Any]) -> Any:
        """POST with retries (HttpRewardTask.post); the reply's JSON, or a TaskError that says what went wrong."""
        try:
            response = self.post(p, payload)
        except ReplyTooLarge as exc:
            raise TaskError(f"http_env {p.url}: {exc}") from None
        except GaveUp as exc:
            raise TaskError(f"http_env {p.url}: no answer after {p.max_retries + 1} tries: {exc}") from None
        # Errors name the status and size only, never the body: they reach the job's owner (rollout
        # reasons), and the URL is the owner's choice, so a body could be another service's answer.
        if response.status_code != 200:
            raise TaskError(f"http_env {p.url}: HTTP {response.status_code} ({len(response.content)} bytes)")
        try:
            return response.json()
        except ValueError:
            raise TaskError(f"http_env {p.url}: the reply ({len(response.content)} bytes) is not JSON") from None


register(HttpEnvTask())
