"""The worker heartbeat, served without the general HTTP stack.

A fleet's heartbeats are most of the control plane's requests (10,000 workers beating every 2 s are 5,000 a
second), and for each the general stack cost more CPU than the work: matching the path through the app's
routers, solving the route's dependencies, parsing the body into a dict and validating that. This middleware
answers a well-formed heartbeat itself: the bearer token from its header, the body validated as a `Heartbeat`
straight from its bytes, the same group commit (`Heartbeats.submit`) and the same reply. Anything else it
hands, body included, to the app, whose route (api/routes/fleet.py, the one OpenAPI documents) answers as for
any request: a missing or malformed token, a body that is not a valid heartbeat, a content type that is not
JSON. So every answer but a well-formed beat's comes from the one place that makes it, and a beat is judged
by the same model either way (tests/api/test_fastpath.py passes with and without this path).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from echo2.protocol import Heartbeat
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import http_problem, problem

log = logging.getLogger(__name__)
PATH = re.compile(r"/v1/workers/([^/]+)/heartbeat")


class HeartbeatPath:
    def __init__(self, app: ASGIApp, route: Any) -> None:
        self.app, self.route = app, route  # the route: what /metrics labels these requests with

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = PATH.fullmatch(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        body = await _body(receive)
        if body is None:  # the client went away mid-body: there is no one to answer
            return
        token, hb = _token(scope), _heartbeat(scope, body)
        if token is None or hb is None:
            await self.app(scope, _replay(body, receive), send)
            return
        scope["route"] = self.route
        try:
            reply = await scope["app"].state.heartbeats.submit(token, match.group(1), hb)
        except HTTPException as exc:
            await http_problem(exc)(scope, receive, send)
            return
        except Exception:
            log.exception("heartbeat failed")
            await problem(500, "internal server error", [])(scope, receive, send)
            return
        await _json(send, reply.model_dump_json().encode())


async def _body(receive: Receive) -> bytes | None:
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read here, once more, for the app; then whatever else the client sends (a disconnect)."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

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
