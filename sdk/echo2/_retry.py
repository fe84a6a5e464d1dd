"""When to retry a request, and how long to wait: exponential backoff with jitter, honouring Retry-After.

Shared by `Client` and `AsyncClient`; pure functions of the attempt number and the answer.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

import httpx

# Methods whose replay cannot do anything twice; a POST is replayable only with an Idempotency-Key.
REPLAYABLE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
# Failures that happen before the request reached the server: safe to retry for any method.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3
    initial_delay: float = 0.5
    max_delay: float = 8.0
    # A Retry-After longer than this is not slept through: the error is raised for the caller to decide.
    max_retry_after: float = 60.0

    def should_retry_status(self, response: httpx.Response) -> bool:
        status = response.status_code
        if status in (429, 503):
            return self._acceptable_retry_after(response)
        if status == 409:  # a conflict is retryable only when the server says it is temporary
            after = retry_after(response.headers)
            return after is not None and after <= self.max_retry_after
        return False

    def should_retry_exception(self, exc: httpx.TransportError, request: httpx.Request) -> bool:
        if isinstance(exc, NOT_SENT):
            return True
        # The request may have been processed: replay it only when that cannot act twice.
        return request.method in REPLAYABLE_METHODS or "Idempotency-Key" in request.headers

    def delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        """Seconds to wait before retry number `attempt + 1` (attempt counts from 0)."""
        if response is not None:
            after = retry_after(response.headers)
            if after is not None:
                # Never earlier than asked; a little later, so clients told the same thing don't stampede.
                return after + random.uniform(0, min(1.0, 0.1 * after))
        base = min(self.max_delay, self.initial_delay * 2.0**attempt)
        return base * (1 - 0.25 * random.random())

    def _acceptable_retry_after(self, response: httpx.Response) -> bool:
        after = retry_after(response.headers)
        return after is None or after <= self.max_retry_after


def retry_after(headers: httpx.Headers) -> float | None:
    """Seconds from the Retry-After header (delta-seconds or HTTP-date), or None when absent/invalid."""
    raw = headers.get("retry-after-ms")
    if raw is not None:
        try:
            return max(0.0, float(raw) / 1000)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - time.time())
