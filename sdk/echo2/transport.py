"""One HTTP layer under every Echo2 client: the SDK's `Client` and `AsyncClient`, the worker's and the
learner's control-plane clients, and the tasks that call a user's own endpoint.

    with Transport("http://127.0.0.1:8000", headers={"Authorization": "Bearer ..."}) as http:
        me = http.send(Call("GET", "/v1/me")).json()

It owns timeouts, retries and the errors raised when they run out. One `RetryPolicy` decides, for both
loops (`Transport` and `AsyncTransport`, which differ only in how they wait), whether to send a call
again and how long to wait first:
- a failure before the request left this machine (connection refused, no free connection) is retried;
- any other transport failure only when a replay cannot act twice: a GET, HEAD, OPTIONS, PUT or DELETE,
  or a call marked `replay=True` (its server answers a repeat as it answered the first);
- an answer whose status the policy names (429 and 503 by default), unless its Retry-After is longer
  than the policy accepts; a 409 only when it carries Retry-After (the server says it is temporary);
- waits grow exponentially with jitter, or are what Retry-After asks (never less), and `give_up_after`
  bounds a call's retries in time as `max_retries` bounds them in number.
Every unsafe call (POST, PUT, PATCH, DELETE) carries one Idempotency-Key, reused by all its retries.
A call to a server nobody vouches for (a user's own endpoint) can bound what it takes: `max_bytes` caps an
answer's body as it is read (a larger one raises `UnexpectedResponseError`, not retried), and `deadline`
bounds each attempt in wall-clock time, headers and body together (past it the attempt fails as a timeout
does). httpx's timeouts are per read, so a server sending a byte now and then would otherwise hold a call
for ever; only `AsyncTransport` can cancel a request mid-way, so only it takes a `deadline`.
When the retries run out: `echo2.errors.ConnectionError` (`APITimeoutError` for a timeout) if no answer
came, else the `APIStatusError` subclass of the last answer's status (with its `retry_after`).
"""

from __future__ import annotations

import logging
import math
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Any

import anyio
import httpx

from . import errors

__all__ = [
    "DEFAULT_TIMEOUT",
    "NOT_SENT",
    "REPLAYABLE_METHODS",
    "UNSAFE_METHODS",
    "AsyncTransport",
    "Call",
    "RetryPolicy",
    "Transport",
    "connection_error",
    "retry_after",
    "status_error",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
# Methods whose replay cannot do anything twice; a POST or PATCH is replayable only when marked so.
REPLAYABLE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Failures that happen before the request reached the server: safe to retry for any method.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


@dataclass(frozen=True)
class Call:
    """One logical request, sent once or more: every retry sends the same, its Idempotency-Key included.
    `url` is absolute or relative to the transport's base URL; `timeout` None means the transport's."""

    method: str
    url: str
    params: Mapping[str, Any] | None = None
    json: Any = None
    content: bytes | None = None
    files: Mapping[str, Any] | None = None
    data: Mapping[str, str] | None = None
    headers: Mapping[str, str] | None = None
    timeout: float | httpx.Timeout | None = None
    # May a request that might have reached the server be sent again? None: its method says.
    replay: bool | None = None
    max_bytes: int | None = None  # the most of an answer's body read (decoded), any status; None: no bound
    deadline: float | None = None  # seconds one attempt may take, body included (AsyncTransport only)

    @property
    def replayable(self) -> bool:
        return self.replay if self.replay is not None else self.method in REPLAYABLE_METHODS


@dataclass(frozen=True)
class RetryPolicy:
    """When to send a call again, and how long to wait first: a pure function of the attempt and the answer."""

    max_retries: int = 3
    initial_delay: float = 0.5
    max_delay: float = 8.0
    statuses: frozenset[int] = frozenset({429, 503})
    retry_conflicts: bool = True  # a 409 with Retry-After
    # A longer Retry-After is not slept through: the error, carrying it, is left to the caller to decide.
    # With `clamp_retry_after` this long is waited instead, and the call tried again.
    max_retry_after: float = 60.0
    clamp_retry_after: bool = False
    give_up_after: float | None = None  # seconds from the first attempt after which no retry starts

    def retries_status(self, response: httpx.Response) -> bool:
        after = retry_after(response.headers)
        if response.status_code == 409 and self.retry_conflicts:
            return after is not None and after <= self.max_retry_after
        if response.status_code not in self.statuses:
            return False
        return after is None or after <= self.max_retry_after or self.clamp_retry_after

    def retries_error(self, exc: httpx.TransportError, call: Call) -> bool:
        # A request that may have been processed is replayed only when that cannot act twice.
        return isinstance(exc, NOT_SENT) or call.replayable

    def delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        """Seconds to wait before retry number `attempt + 1` (attempt counts from 0)."""
        after = retry_after(response.headers) if response is not None else None
        if after is not None:
            after = min(after, self.max_retry_after)
            # Never earlier than asked; a little later, so clients told the same thing don't stampede.
            return after + random.uniform(0, min(1.0, 0.1 * after))
        return self.backoff(attempt)

    def backoff(self, attempt: int) -> float:
        """Exponential backoff from `initial_delay`, capped at `max_delay`, with up to a quarter off at random."""
        base = min(self.max_delay, self.initial_delay * 2.0 ** min(attempt, 64))
        return base * (1 - 0.25 * random.random())


def retry_after(headers: httpx.Headers) -> float | None:
    """Seconds from Retry-After-Ms, or Retry-After (delta-seconds or HTTP-date); None when absent or invalid."""
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


def connection_error(exc: httpx.TransportError, request: httpx.Request) -> errors.ConnectionError:
    """The SDK's error for a request that got no answer (also for a stream broken while being read)."""
    where = f"{request.method} {request.url}"
    if isinstance(exc, httpx.TimeoutException):
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return errors.APITimeoutError(f"request timed out: {where} ({why})", request=request)
    reason = str(exc) or type(exc).__name__
    return errors.ConnectionError(f"could not reach the Echo2 server: {where}: {reason}", request=request)


def status_error(response: httpx.Response) -> errors.APIStatusError:
    return errors.error_from_response(response, retry_after(response.headers))


class _Attempts:
    """One call's attempts so far: whether the policy allows another, and how long to wait before it."""

    def __init__(self, policy: RetryPolicy, call: Call) -> None:
        self.policy, self.call, self.count = policy, call, 0
        self.deadline = None if policy.give_up_after is None else time.monotonic() + policy.give_up_after

    def after_error(self, exc: httpx.TransportError) -> float | None:
        """Seconds to wait before trying again after `exc`, or None to give up."""
        if not (self._left() and self.policy.retries_error(exc, self.call)):
            return None
        return self._next(None, f"{type(exc).__name__}: {exc}")

    def after_answer(self, response: httpx.Response) -> float | None:
        """Seconds to wait before trying again after this answer, or None to keep it."""
        if response.is_success or not (self._left() and self.policy.retries_status(response)):
            return None
        return self._next(response, f"HTTP {response.status_code}")

    def _left(self) -> bool:
        in_time = self.deadline is None or time.monotonic() < self.deadline
        return self.count < self.policy.max_retries and in_time

    def _next(self, response: httpx.Response | None, failure: str) -> float:
        wait = self.policy.delay(self.count, response)
        self.count += 1
        log.info("%s %s failed (%s); retry %d in %.1fs", self.call.method, self.call.url, failure, self.count, wait)
        return wait


class _BaseTransport:
    def __init__(self, policy: RetryPolicy, idempotency_keys: bool) -> None:
        self.policy, self.idempotency_keys = policy, idempotency_keys

    def _headers(self, call: Call) -> httpx.Headers:
        """The call's headers, with the Idempotency-Key all its attempts send."""
        headers = httpx.Headers(call.headers)
        if self.idempotency_keys and call.method in UNSAFE_METHODS and "idempotency-key" not in headers:
            headers["Idempotency-Key"] = str(uuid.uuid4())
        return headers

    def _build(self, http: httpx.Client | httpx.AsyncClient, call: Call, headers: httpx.Headers) -> httpx.Request:
        timeout = call.timeout if call.timeout is not None else http.timeout
        return http.build_request(call.method, call.url, params=call.params, json=call.json, content=call.content,
                                  files=call.files, data=call.data, headers=headers, timeout=timeout)


class Transport(_BaseTransport):
    """Synchronous: sends calls through one `httpx.Client`; safe to share between threads."""

    def __init__(self, base_url: str = "", *, headers: Mapping[str, str] | None = None,
                 timeout: float | httpx.Timeout = DEFAULT_TIMEOUT, policy: RetryPolicy | None = None,
                 idempotency_keys: bool = True) -> None:
        super().__init__(policy or RetryPolicy(), idempotency_keys)
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)

    def send(self, call: Call, *, stream: bool = False, policy: RetryPolicy | None = None) -> httpx.Response:
        """The call's successful answer (unread when `stream`: close it), after the retries the policy allows."""
        if call.deadline is not None:
            raise ValueError("Call.deadline needs AsyncTransport: a blocking httpx request cannot be cut off mid-way")
        attempts, headers = _Attempts(policy or self.policy, call), self._headers(call)
        bounded = call.max_bytes is not None and not stream
        while True:
            request = self._build(self.http, call, headers)
            try:
                response = self.http.send(request, stream=stream or bounded)
                if bounded:
                    streamed = response
                    try:
                        response = _bounded(streamed, streamed.iter_bytes(), call)
                    finally:
                        streamed.close()
            except httpx.TransportError as exc:
                wait = attempts.after_error(exc)
                if wait is None:
                    raise connection_error(exc, request) from exc
                time.sleep(wait)
                continue
            wait = attempts.after_answer(response)
            if wait is None:
                break
            response.close()
            time.sleep(wait)
        if not response.is_success:
            response.read()
            response.close()
            raise status_error(response)
        return response

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AsyncTransport(_BaseTransport):
    """Asynchronous: the same calls, policy and errors as `Transport`, through one `httpx.AsyncClient`."""

    def __init__(self, base_url: str = "", *, headers: Mapping[str, str] | None = None,
                 timeout: float | httpx.Timeout = DEFAULT_TIMEOUT, policy: RetryPolicy | None = None,
                 idempotency_keys: bool = True) -> None:
        super().__init__(policy or RetryPolicy(), idempotency_keys)
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout)

    async def send(self, call: Call, *, stream: bool = False, policy: RetryPolicy | None = None) -> httpx.Response:
        attempts, headers = _Attempts(policy or self.policy, call), self._headers(call)
        bounded = call.max_bytes is not None and not stream
        while True:
            request = self._build(self.http, call, headers)
            try:
                response = await self._attempt(request, call, stream=stream, bounded=bounded)
            except httpx.TransportError as exc:
                wait = attempts.after_error(exc)
                if wait is None:
                    raise connection_error(exc, request) from exc
                await anyio.sleep(wait)
                continue
            wait = attempts.after_answer(response)
            if wait is None:
                break
            await response.aclose()
            await anyio.sleep(wait)
        if not response.is_success:
            await response.aread()
            await response.aclose()
            raise status_error(response)
        return response

    async def _attempt(self, request: httpx.Request, call: Call, *, stream: bool, bounded: bool) -> httpx.Response:
        """One attempt, within `call.deadline` (a ReadTimeout past it, as if the server had gone quiet)."""
        with anyio.move_on_after(call.deadline if call.deadline is not None else math.inf) as scope:
            response = await self.http.send(request, stream=stream or bounded)
            if bounded:
                return _bounded(response, [chunk async for chunk in _capped(response, call)], call)
            return response
        assert scope.cancelled_caught
        raise httpx.ReadTimeout(f"no whole answer within the call's deadline of {call.deadline} s", request=request)

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncTransport:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


def _bounded(response: httpx.Response, chunks: Iterable[bytes], call: Call) -> httpx.Response:
    """The streamed answer read whole, or UnexpectedResponseError once its body passes `call.max_bytes`."""
    assert call.max_bytes is not None
    body, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        if size > call.max_bytes:
            raise errors.UnexpectedResponseError(f"{call.method} {call.url}: an answer (HTTP "
                                                 f"{response.status_code}) of more than {call.max_bytes} bytes",
                                                 response=response)
        body.append(chunk)
    # Decoded already: the new answer must not say it is compressed, nor give the old length.
    headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in ("content-encoding",
                                                                                        "content-length")]
    return httpx.Response(response.status_code, headers=headers, content=b"".join(body), request=response.request)


async def _capped(response: httpx.Response, call: Call) -> AsyncIterator[bytes]:
    """The async answer's body chunks, stopping (and closing it) one chunk past `call.max_bytes`."""
    assert call.max_bytes is not None
    size = 0
    try:
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            yield chunk
            if size > call.max_bytes:
                return
    finally:
        await response.aclose()
