"""`http_reward`: the user's own verifier behind an HTTP endpoint.

For each completion the learner POSTs JSON {"prompt", "completion", "reference"} to `url` and expects a finite
number within ±1e6 back (REWARD_BOUND), either bare (`0.5`) or as {"reward": 0.5}. Transport errors, timeouts,
429 and 5xx are retried `max_retries` times with exponential backoff (honouring Retry-After, capped), through
`echo2.transport`; once they are spent, any other failure or an invalid reply raises ScoringError naming it:
the group is not trained, and a job whose endpoint keeps failing pauses with that reason. Each try has
`timeout_s` for the whole exchange, and a reply may hold MAX_REPLY_BYTES: the endpoint is the job owner's, so
a reply that never ends, or never stops growing, must not hold a thread or fill the memory of the process that
asked. Prompts come from user JSONL items {"prompt": ..., "reference": ...} (reference optional), or chat
items (`messages`), whose last user turn is the prompt.

The request is made from the learner host. With ECHO2_ENV=production a job is refused unless the URL resolves
to public addresses (api/services/jobs.py); deployments should still restrict egress there, as a name may
resolve elsewhere later."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import anyio
import httpx
from echo2 import errors
from echo2.transport import AsyncTransport, Call, RetryPolicy
from pydantic import Field, field_validator

from tasks.base import ScoringError, TaskAdapter, TaskParams, TaskPrompt, require_key
from tasks.registry import register

logger = logging.getLogger(__name__)
MAX_RETRY_AFTER_S = 10.0
RETRY_STATUSES = frozenset({429, *range(500, 600)})
MAX_REPLY_BYTES = 64 * 1024


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


class GaveUp(Exception):
    """No usable answer after every try; the message names the last failure (never the reply's body)."""


class ReplyTooLarge(GaveUp):
    """The reply was longer than MAX_REPLY_BYTES (not retried)."""


def _policy(p: HttpRewardParams) -> RetryPolicy:
    """Retries of transport errors, timeouts, 429 and 5xx: `max_retries`, waits doubling from `backoff_s`,
    a Retry-After honoured up to MAX_RETRY_AFTER_S."""
    return RetryPolicy(max_retries=p.max_retries, initial_delay=p.backoff_s, max_delay=math.inf,
                       statuses=RETRY_STATUSES, retry_conflicts=False, max_retry_after=MAX_RETRY_AFTER_S,
                       clamp_retry_after=True)


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


class HttpRewardTask(TaskAdapter):
    name = "http_reward"
    description = "Reward computed by the user's HTTP endpoint (POST prompt/completion/reference)."
    Params = HttpRewardParams
    needs_dataset = True

    def prompt_from_item(self, item: Mapping[str, Any], params: TaskParams) -> TaskPrompt:
        p = self.parse_params(params)
        assert isinstance(p, HttpRewardParams)
        text = require_key(item, p.prompt_key, self.name)
        reference = require_key(item, p.reference_key, self.name) if p.reference_key in item else None
        return TaskPrompt(text=text, reference=reference)

    def reward(self, prompt: TaskPrompt, completion: str, params: TaskParams) -> float:
        p = self.parse_params(params)
        assert isinstance(p, HttpRewardParams)
        payload = {"prompt": prompt.text, "completion": completion, "reference": prompt.reference}
        try:
            response = self.post(p, payload)
        except GaveUp as exc:
            logger.warning("http_reward %s: giving up after %d tries: %s", p.url, p.max_retries + 1, exc)
            raise ScoringError(f"{p.url} gave no answer after {p.max_retries + 1} tries: {exc}") from None
        if response.status_code != 200:
            logger.warning("http_reward %s: HTTP %d, sample left unscored", p.url, response.status_code)
            raise ScoringError(f"{p.url} answered HTTP {response.status_code}")
        value = _parse_reward(response)
        if value is None:
            logger.warning("http_reward %s: reply is not a finite number: %.200r", p.url, response.text)
            raise ScoringError(f"{p.url} answered {response.text[:80]!r}, not a finite number or "
                               '{"reward": number}')
        return value

    def post(self, p: HttpRewardParams, payload: dict[str, Any]) -> httpx.Response:
        """POST `payload` to `p.url`, retrying transport errors, timeouts, 429 and 5xx (`_policy`): the answer
        whatever its status, or GaveUp naming the last failure once the retries ran out (ReplyTooLarge for
        a reply over MAX_REPLY_BYTES). Called from worker threads, each call in an event loop of its own:
        only the async transport can cut a try off at its deadline."""
        # The endpoint answers a repeat as the first (replay), and gets exactly the request documented
        # above: no Idempotency-Key.
        call = Call("POST", p.url, json=payload, replay=True, max_bytes=MAX_REPLY_BYTES, deadline=p.timeout_s)
        try:
            return anyio.run(_send, call, p)
        except errors.UnexpectedResponseError:
            raise ReplyTooLarge(f"a reply of more than {MAX_REPLY_BYTES} bytes") from None
        except errors.APIStatusError as exc:
            if exc.status not in RETRY_STATUSES and exc.response is not None:
                return exc.response  # not retried: the caller judges the answer
            raise GaveUp(f"HTTP {exc.status}") from None
        except errors.ConnectionError as exc:
            cause = exc.__cause__
            raise GaveUp(f"{type(cause).__name__}: {cause}") from None

async def _send(call: Call, p: HttpRewardParams) -> httpx.Response:
    async with AsyncTransport(timeout=p.timeout_s, idempotency_keys=False) as http:
        return await http.send(call, policy=_policy(p))


register(HttpRewardTask())
