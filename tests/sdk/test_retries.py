"""Retries against a real local HTTP server: backoff, Retry-After, bounds, one idempotency key per create."""

from __future__ import annotations

import asyncio
import time
import uuid
from email.utils import formatdate
from itertools import pairwise

import httpx
import pytest
from echo2 import (
    APIStatusError,
    AsyncClient,
    Client,
    ConflictError,
    ConnectionError,
    RateLimitError,
    ServerError,
)
from echo2.transport import retry_after

from server.local import free_port

from .conftest import SPEC
from .stub import Reply, job_body, problem


def _busy(after: str = "1") -> Reply:
    return problem(503, "warming up", **{"Retry-After": after})


def test_create_retries_503_honouring_retry_after_with_one_idempotency_key(stub):
    stub.reply(_busy(), _busy(), Reply(201, job_body("j1")))
    with Client(stub.url, "k") as client:
        job = client.jobs.create(SPEC)
    assert job.id == "j1" and [s.method for s in stub.seen] == ["POST"] * 3
    keys = {s.headers["idempotency-key"] for s in stub.seen}
    assert len(keys) == 1 and uuid.UUID(keys.pop())
    assert all(b.at - a.at >= 1.0 for a, b in pairwise(stub.seen))
    first = stub.seen[0].headers["idempotency-key"]
    stub.reply(Reply(201, job_body("j2")))
    with Client(stub.url, "k") as client:
        client.jobs.create(SPEC)
    assert stub.seen[0].headers["idempotency-key"] != first  # a new logical POST, a new key


def test_async_create_retries_with_one_idempotency_key(stub):
    stub.reply(_busy(), _busy(), Reply(201, job_body("j1")))

    async def main() -> str:
        async with AsyncClient(stub.url, "k") as client:
            return (await client.jobs.create(SPEC, idempotency_key="mine")).id

    assert asyncio.run(main()) == "j1"
    assert [s.headers["idempotency-key"] for s in stub.seen] == ["mine"] * 3
    assert all(b.at - a.at >= 1.0 for a, b in pairwise(stub.seen))


def test_retries_are_bounded(stub):
    stub.reply(_busy("0"))
    with Client(stub.url, "k", max_retries=2) as client, pytest.raises(ServerError) as info:
        client.jobs.get("j1")
    assert info.value.status == 503 and info.value.retry_after == 0 and len(stub.seen) == 3
    stub.reply(_busy("0"))
    with Client(stub.url, "k", max_retries=0) as client, pytest.raises(ServerError):
        client.jobs.get("j1")
    assert len(stub.seen) == 1


def test_429_without_retry_after_backs_off_exponentially(stub):
    stub.reply(problem(429, "slow down"), problem(429, "slow down"), Reply(200, job_body()))
    with Client(stub.url, "k") as client:
        assert client.jobs.get("job1").id == "job1"
    gaps = [b.at - a.at for a, b in pairwise(stub.seen)]
    # ~0.5 s then ~1 s, jitter taking off up to a quarter; only lower bounds (a busy box adds delay)
    assert len(gaps) == 2 and gaps[0] >= 0.37 and gaps[1] >= 0.74


def test_retry_after_beyond_the_cap_is_left_to_the_caller(stub):
    stub.reply(problem(429, "quota", **{"Retry-After": "3600"}))
    with Client(stub.url, "k") as client, pytest.raises(RateLimitError) as info:
        client.jobs.list()
    assert info.value.retry_after == 3600 and len(stub.seen) == 1


def test_409_is_retried_only_when_the_server_sends_retry_after(stub):
    stub.reply(problem(409, "job already finished"))
    with Client(stub.url, "k") as client, pytest.raises(ConflictError):
        client.jobs.cancel("j1")
    assert len(stub.seen) == 1
    stub.reply(problem(409, "no prompts available", **{"Retry-After": "0"}), Reply(200, job_body()))
    with Client(stub.url, "k") as client:
        assert client.jobs.cancel("job1").id == "job1"
    assert len(stub.seen) == 2


def test_other_errors_are_not_retried(stub):
    for status in (500, 404, 422):
        stub.reply(problem(status, "no"))
        with Client(stub.url, "k") as client, pytest.raises(APIStatusError) as info:
            client.jobs.get("j1")
        assert info.value.status == status and len(stub.seen) == 1


def test_connection_errors_are_retried_with_backoff():
    with Client(f"http://127.0.0.1:{free_port()}", "k", max_retries=2) as client:
        started = time.monotonic()
        with pytest.raises(ConnectionError):
            client.users.me()
    assert time.monotonic() - started >= 0.5 * 0.75 + 1.0 * 0.75  # two waits of the backoff


def test_retry_after_header_forms():
    assert retry_after(httpx.Headers({"Retry-After": "2"})) == 2
    assert retry_after(httpx.Headers({"Retry-After": "1.5"})) == 1.5
    assert retry_after(httpx.Headers({"retry-after-ms": "250"})) == 0.25
    assert 8 <= retry_after(httpx.Headers({"Retry-After": formatdate(time.time() + 10, usegmt=True)})) <= 10
    assert retry_after(httpx.Headers({"Retry-After": formatdate(time.time() - 10, usegmt=True)})) == 0
    assert retry_after(httpx.Headers({"Retry-After": "soon"})) is None
    assert retry_after(httpx.Headers({})) is None
