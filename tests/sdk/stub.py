"""A tiny real HTTP server for what the control plane never does on purpose: scripted 503s, 429s,
Retry-After, broken bodies and hostile checkpoint tars. It records every request it receives."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from server.local import free_port


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    media_type: str = "application/json"


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    at: float


class StubServer:
    """Answers each request with the next scripted reply (the last one repeats)."""

    def __init__(self) -> None:
        self.script: list[Reply] = []
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        methods = ["GET", "POST", "DELETE", "PUT"]
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=methods)])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> StubServer:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("stub server failed to start")
            threading.Event().wait(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def reply(self, *replies: Reply) -> None:
        with self._lock:
            self.script = list(replies)
            self.seen = []

    async def _handle(self, request: Request) -> Response:
        await request.body()
        with self._lock:
            self.seen.append(Seen(request.method, request.url.path, dict(request.headers), time.monotonic()))
            reply = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        return Response(reply.body, status_code=reply.status, headers=reply.headers,
                        media_type=reply.media_type)


def problem(status: int, detail: str, **headers: str) -> Reply:
    body = {"type": "about:blank", "title": "Error", "status": status, "detail": detail, "errors": []}
    return Reply(status, json.dumps(body).encode(), headers, "application/problem+json")


def job_body(job_id: str = "job1") -> bytes:
    """A valid JobRead, as a control plane would answer a create."""
    from echo2.protocol import JobRead

    now = datetime.now(UTC)
    job: dict[str, Any] = {
        "id": job_id, "name": "stub", "owner_id": "u1", "status": "queued", "step": 0, "version": None,
        "num_prompts": 4,
        "created_at": now.isoformat(),
        "spec": {"name": "stub", "base_model": "echo2:tiny", "task": {"name": "arithmetic"}},
    }
    return JobRead.model_validate(job).model_dump_json().encode()
