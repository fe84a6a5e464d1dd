"""`http_reward`: the user's own verifier behind an HTTP endpoint.

For each completion the learner POSTs JSON {"prompt", "completion", "reference"} to `url` and expects
a finite number back, either bare (`0.5`) or as {"reward": 0.5}. Transport errors, timeouts, 429 and
5xx are retried `max_retries` times with exponential backoff (honouring a numeric Retry-After, capped);
any other failure or an invalid reply yields None (the sample is dropped) and is logged. Prompts come
from user JSONL items {"prompt": ..., "reference": ...} (reference optional).

The request is made from the learner host; deployments that must not reach internal addresses
should restrict egress there.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from typing import Any

import httpx
from pydantic import Field, field_validator

from learner.tasks.base import TaskAdapter, TaskParams, TaskPrompt, require_key
from learner.tasks.registry import register

logger = logging.getLogger(__name__)
MAX_RETRY_AFTER_S = 10.0


class HttpRewardParams(TaskParams):
    url: str = Field(min_length=8, max_length=2000)
    timeout_s: float = Field(default=10.0, gt=0.0, le=120.0)
    max_retries: int = Field(default=2, ge=0, le=5)
    backoff_s: float = Field(default=0.5, ge=0.0, le=10.0)
    concurrency: int = Field(default=8, ge=1, le=64, description="Requests in flight at once.")
    prompt_key: str = Field(default="prompt", min_length=1, max_length=64)
    reference_key: str = Field(default="reference", min_length=1, max_length=64)

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        url = httpx.URL(v)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError("must be an absolute http:// or https:// URL")
        return v


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.retry_after = retry_after


def _parse_reward(response: httpx.Response) -> float | None:
    try:
        body = response.json()
    except ValueError:
        return None
    if isinstance(body, Mapping):
        body = body.get("reward")
    if isinstance(body, bool) or not isinstance(body, int | float):
        return None
    value = float(body)
    return value if math.isfinite(value) else None


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return min(float(response.headers["retry-after"]), MAX_RETRY_AFTER_S)
    except (KeyError, ValueError):
        return None


class HttpRewardTask(TaskAdapter):
    name = "http_reward"
    description = "Reward computed by the user's HTTP endpoint (POST prompt/completion/reference)."
    Params = HttpRewardParams
    needs_dataset = True

    def __init__(self) -> None:
        self._clients: dict[float, httpx.Client] = {}
        self._lock = threading.Lock()

    def _client(self, timeout_s: float) -> httpx.Client:
        with self._lock:
            client = self._clients.get(timeout_s)
            if client is None:
                client = httpx.Client(timeout=timeout_s, follow_redirects=False)
                self._clients[timeout_s] = client
            return client

    def prompt_from_item(self, item: Mapping[str, Any], params: TaskParams) -> TaskPrompt:
        p = self.parse_params(params)
        assert isinstance(p, HttpRewardParams)
        text = require_key(item, p.prompt_key, self.name)
        reference = require_key(item, p.reference_key, self.name) if p.reference_key in item else None
        return TaskPrompt(text=text, reference=reference)

    def reward(self, prompt: TaskPrompt, completion: str, params: TaskParams) -> float | None:
        p = self.parse_params(params)
        assert isinstance(p, HttpRewardParams)
        payload = {"prompt": prompt.text, "completion": completion, "reference": prompt.reference}
        try:
            response = self.post(p, payload)
        except _Retryable as exc:
            logger.warning("http_reward %s: giving up after %d tries: %s", p.url, p.max_retries + 1, exc)
            return None
        if response.status_code != 200:
            logger.warning("http_reward %s: HTTP %d, sample left unscored", p.url, response.status_code)
            return None
        value = _parse_reward(response)
        if value is None:
            logger.warning("http_reward %s: reply is not a finite number: %.200r", p.url, response.text)
        return value

    def post(self, p: HttpRewardParams, payload: dict[str, Any]) -> httpx.Response:
        """POST `payload` to `p.url`, retrying transport errors, timeouts, 429 and 5xx `max_retries` times
        with backoff (a numeric Retry-After honoured); the last such failure is raised as _Retryable."""
        attempt = 0
        while True:
            try:
                return self._post_once(p, payload)
            except _Retryable as exc:
                if attempt == p.max_retries:
                    raise
                time.sleep(exc.retry_after if exc.retry_after is not None else p.backoff_s * 2**attempt)
                attempt += 1

    def _post_once(self, p: HttpRewardParams, payload: dict[str, Any]) -> httpx.Response:
        try:
            response = self._client(p.timeout_s).post(p.url, json=payload)
        except httpx.TransportError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None
        if response.status_code == 429 or response.status_code >= 500:
            raise _Retryable(f"HTTP {response.status_code}", _retry_after(response))
        return response

register(HttpRewardTask())
