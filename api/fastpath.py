"""The worker heartbeat, served without the general HTTP stack.

A fleet's heartbeats are most of the control plane's requests (10,000 workers beating every 2 s are 5,000 a
second), and for each the general stack cost more CPU than the work: resuming through each of the app's
middleware layers, matching the path through its routers, solving the route's dependencies, parsing the body
into a dict and validating that. This layer, outside all the others (api/app.py), answers a well-formed
heartbeat itself: the bearer token from its header, the body validated as a `Heartbeat` straight from its
bytes, the same group commit (`Heartbeats.submit`) and the same reply. Anything else it hands, body included,
to the app, whose route (api/routes/fleet.py, the one OpenAPI documents) answers as for any request: a missing
or malformed token, a body that is not a valid heartbeat, a content type that is not JSON. So every answer but
a well-formed beat's comes from the one place that makes it, and a beat is judged by the same model either way
(tests/api/test_fastpath.py passes with and without this path).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from echo2.protocol import Heartbeat
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import http_problem, problem
from .telemetry import Telemetry

log = logging.getLogger(__name__)
PATH = re.compile(r"/v1/workers/([^/]+)/heartbeat")


class HeartbeatPath:
    """Outside every other layer of the app (api/app.py): a beat passes no middleware it does not need. It does
    what those layers would have done for it: bounds the body as BodyLimit does (a larger one goes on to the app,
    which refuses it) and counts the beat in /metrics under its route, as MetricsMiddleware counts the rest."""

    def __init__(self, app: ASGIApp, route: Any, telemetry: Telemetry, limit: int) -> None:
        self.app, self.label, self.t, self.limit = app, route.path, telemetry, limit
        # The metrics' children for this route, looked up once: `labels()` on every beat was 2 % of its CPU.
        self.latency = telemetry.latency.labels("POST", route.path)
        self.counts: dict[int, Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = PATH.fullmatch(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        read, body = await _body(receive, self.limit)
        if read[-1]["type"] != "http.request":  # the client went away mid-body: there is no one to answer
            return
        token, hb = _token(scope), None if body is None else _heartbeat(scope, body)
        if token is None or hb is None:
            await self.app(scope, _replay(read, receive), send)
            return
        status = 500
        try:
            status = await self._answer(scope, receive, send, token, match.group(1), hb)
        finally:
            if status not in self.counts:
                self.counts[status] = self.t.requests.labels("POST", self.label, str(status))
            self.counts[status].inc()
            self.latency.observe(time.perf_counter() - start)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, token: str, worker_id: str,
                      hb: Heartbeat) -> int:
        try:
            reply = await scope["app"].state.heartbeats.submit(token, worker_id, hb)
        except HTTPException as exc:
            response = http_problem(exc)
        except Exception:
            log.exception("heartbeat failed")
            response = problem(500, "internal server error", [])
        else:
            await _json(send, reply.model_dump_json().encode())
            return 200
        await response(scope, receive, send)
        return response.status_code


async def _body(receive: Receive, limit: int) -> tuple[list[Message], bytes | None]:
    """The messages read, and the body: None where the client went away or sent more than `limit` bytes (the
    messages read so far then go on to the app with the rest)."""
    read: list[Message] = []
    size, more = 0, True
    while more:
        read.append(message := await receive())
        if message["type"] != "http.request":
            return read, None
        size += len(message.get("body", b""))
        if size > limit:
            return read, None
        more = message.get("more_body", False)
    return read, b"".join(m.get("body", b"") for m in read)


def _replay(read: list[Message], receive: Receive) -> Receive:
    """The messages read here, once more, for the app; then whatever else the client sends."""
    pending = list(read)

    async def again() -> Message:
        return pending.pop(0) if pending else await receive()

    return again


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _token(scope: Scope) -> str | None:
    """The bearer token, parsed as the route's HTTPBearer dependency parses it."""
    value = _header(scope, b"authorization")
    scheme, credentials = get_authorization_scheme_param(None if value is None else value.decode("latin-1"))
    return credentials if scheme.lower() == "bearer" and credentials else None


def _heartbeat(scope: Scope, body: bytes) -> Heartbeat | None:
    kind = _header(scope, b"content-type")
    if kind is None or kind.split(b";")[0].strip().lower() != b"application/json":
        return None
    try:
        return Heartbeat.model_validate_json(body)
    except ValidationError:
        return None


async def _json(send: Send, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
