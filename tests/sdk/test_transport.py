"""`echo2.transport`, the HTTP layer under the SDK, the worker and the learner, against real local
servers: idempotency keys, replay of calls that may have reached the server, a give-up deadline,
Retry-After clamped or left to the caller, and the async loop under the same policy."""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from echo2 import APITimeoutError, ConflictError, ConnectionError, RateLimitError, ServerError, UnexpectedResponseError
from echo2.transport import AsyncTransport, Call, RetryPolicy, Transport

from server.local import free_port

from .stub import Reply, problem

QUICK = RetryPolicy(max_retries=2, initial_delay=0.01, max_delay=0.02)


def test_unsafe_calls_carry_one_idempotency_key_across_their_retries(stub):
    with Transport(stub.url, policy=QUICK) as http:
        for method in ("POST", "PUT", "DELETE"):
            stub.reply(problem(503, "busy", **{"Retry-After": "0"}), Reply(200, b"{}"))
            http.send(Call(method, "/x"))
            keys = {s.headers.get("idempotency-key") for s in stub.seen}
            assert len(stub.seen) == 2 and len(keys) == 1 and None not in keys, method
        stub.reply(Reply(200, b"{}"))
        http.send(Call("GET", "/x"))
        assert "idempotency-key" not in stub.seen[0].headers
        http.send(Call("POST", "/x", headers={"Idempotency-Key": "mine"}))
        assert stub.seen[-1].headers["idempotency-key"] == "mine"
    with Transport(stub.url, idempotency_keys=False) as http:  # a user's endpoint gets only what it was promised
        http.send(Call("POST", "/x"))
        assert "idempotency-key" not in stub.seen[-1].headers


@pytest.fixture
def silent() -> Iterator[tuple[str, list[socket.socket]]]:
    """A server that accepts connections and never answers: every request times out after it was sent."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    server.close()
    for conn in accepted:
        conn.close()


def test_a_call_that_may_have_reached_the_server_is_replayed_only_when_marked(silent):
    url, accepted = silent
    with Transport(url, timeout=0.2, policy=QUICK) as http:
        with pytest.raises(APITimeoutError):
            http.send(Call("POST", "/lease"))
        assert len(accepted) == 1
        with pytest.raises(APITimeoutError):
            http.send(Call("POST", "/heartbeat", replay=True))
        assert len(accepted) == 1 + 3
        with pytest.raises(APITimeoutError):
            http.send(Call("GET", "/version"))  # a GET cannot act twice
        assert len(accepted) == 1 + 3 + 3


def test_the_deadline_bounds_retries_in_time():
    patient = RetryPolicy(max_retries=1_000, initial_delay=0.05, max_delay=0.1, give_up_after=0.6)
    with Transport(f"http://127.0.0.1:{free_port()}", policy=patient) as http:
        started = time.monotonic()
        with pytest.raises(ConnectionError, match="could not reach"):
            http.send(Call("GET", "/v1/me"))
    assert 0.6 <= time.monotonic() - started < 5


def test_the_deadline_ends_on_the_last_answer(stub):
    stub.reply(problem(503, "restarting", **{"Retry-After": "0"}))
    patient = RetryPolicy(max_retries=1_000, give_up_after=0.5, max_retry_after=math.inf)
    with Transport(stub.url, policy=patient) as http, pytest.raises(ServerError) as info:
        http.send(Call("GET", "/x"))
    assert info.value.status == 503 and len(stub.seen) > 2


def test_a_long_retry_after_is_left_to_the_caller_or_clamped(stub):
    stub.reply(problem(429, "quota", **{"Retry-After": "3600"}), Reply(200, b"{}"))
    with Transport(stub.url, policy=RetryPolicy(max_retry_after=0.2)) as http, pytest.raises(RateLimitError):
        http.send(Call("GET", "/x"))
    assert len(stub.seen) == 1
    stub.reply(problem(429, "quota", **{"Retry-After": "3600"}), Reply(200, b"{}"))
    clamped = RetryPolicy(max_retry_after=0.2, clamp_retry_after=True)
    with Transport(stub.url, policy=clamped) as http:
        started = time.monotonic()
        assert http.send(Call("GET", "/x")).status_code == 200
    assert len(stub.seen) == 2 and 0.2 <= stub.seen[1].at - stub.seen[0].at < 2 and time.monotonic() - started < 2


def test_statuses_and_conflicts_are_the_policys(stub):
    stub.reply(problem(502, "bad gateway"), Reply(200, b"{}"))
    with Transport(stub.url, policy=QUICK) as http, pytest.raises(ServerError):
        http.send(Call("GET", "/x"))  # not a status the default policy retries
    worker_like = RetryPolicy(initial_delay=0.01, statuses=frozenset({502}), retry_conflicts=False)
    with Transport(stub.url, policy=worker_like) as http:
        stub.reply(problem(502, "bad gateway"), Reply(200, b"{}"))
        assert http.send(Call("GET", "/x")).status_code == 200
        stub.reply(problem(409, "no prompts", **{"Retry-After": "0"}), Reply(200, b"{}"))
        with pytest.raises(ConflictError):
            http.send(Call("POST", "/x"))
        assert len(stub.seen) == 1


def test_the_async_transport_follows_the_same_policy(stub):
    stub.reply(problem(503, "busy", **{"Retry-After": "0"}), problem(503, "busy"), Reply(200, b'{"ok": true}'))

    async def main() -> dict:
        async with AsyncTransport(stub.url, policy=QUICK) as http:
            return (await http.send(Call("POST", "/x", replay=True))).json()

    assert asyncio.run(main()) == {"ok": True}
    assert len(stub.seen) == 3 and len({s.headers["idempotency-key"] for s in stub.seen}) == 1


def test_delays_honour_retry_after_and_back_off():
    policy = RetryPolicy(initial_delay=0.5, max_delay=8.0)
    asked = httpx.Response(503, headers={"Retry-After": "2"})
    assert all(2.0 <= policy.delay(0, asked) <= 2.2 for _ in range(50))
    assert all(0.375 <= policy.delay(0) <= 0.5 for _ in range(50))
    assert all(6.0 <= policy.delay(10) <= 8.0 for _ in range(50))
    assert all(0.1 <= RetryPolicy(max_retry_after=0.1).delay(0, asked) <= 0.11 for _ in range(50))


@pytest.fixture
def dripping() -> Iterator[str]:
    """A server that answers 200 at once, then sends its body one byte every 0.1 s for as long as asked."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
            for _ in range(100000):
                conn.sendall(b"x")
                time.sleep(0.1)

    def accept() -> None:
        while True:
            try:
                conn = server.accept()[0]
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def test_an_answer_over_max_bytes_is_refused_as_it_is_read_whatever_its_status(stub):
    big = b'{"x": "' + b"y" * 1_000_000 + b'"}'
    once = RetryPolicy(max_retries=0)

    async def read_async(call: Call) -> httpx.Response:
        async with AsyncTransport(stub.url, policy=once) as http:
            return await http.send(call)

    for send in (lambda call: Transport(stub.url, policy=once).send(call), lambda call: asyncio.run(read_async(call))):
        for status in (200, 500):
            stub.reply(Reply(status, big))
            with pytest.raises(UnexpectedResponseError, match=f"HTTP {status}.* more than 1000 bytes"):
                send(Call("POST", "/x", max_bytes=1000))
        stub.reply(Reply(200, b'{"ok": true}', {"Content-Encoding": "identity"}))
        assert send(Call("POST", "/x", max_bytes=1000)).json() == {"ok": True}


def test_a_deadline_cuts_off_an_answer_that_drips(dripping):
    """httpx's timeouts are per read: a byte every 0.1 s never trips a 1 s timeout, but the deadline ends it."""
    policy = RetryPolicy(max_retries=1, initial_delay=0.01)

    async def main() -> None:
        async with AsyncTransport(dripping, timeout=1.0, policy=policy) as http:
            await http.send(Call("POST", "/x", replay=True, max_bytes=10**6, deadline=0.5))

    started = time.monotonic()
    with pytest.raises(APITimeoutError, match="deadline"):
        asyncio.run(main())
    assert 1.0 <= time.monotonic() - started < 2.5  # two tries of 0.5 s
    with pytest.raises(ValueError, match="needs AsyncTransport"):
        Transport(dripping).send(Call("GET", "/x", deadline=0.5))
