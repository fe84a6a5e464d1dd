"""Problem+json (RFC 9457) errors that name the field and the reason, and the body-size guard."""

from __future__ import annotations

import logging
import re

from echo2.protocol.common import reason
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)
PROBLEM = "application/problem+json"


class ApiError(StarletteHTTPException):
    """An error a client can act on: status, title, detail and optional per-field reasons."""

    def __init__(
        self, status: int, detail: str, *, field: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(status_code=status, detail=detail, headers=headers)
        self.errors = [{"field": field, "reason": detail}] if field else []


def unauthorized(detail: str) -> ApiError:
    return ApiError(401, detail, headers={"WWW-Authenticate": "Bearer"})


def not_found(what: str) -> ApiError:
    return ApiError(404, f"{what} not found")


def conflict(detail: str, field: str | None = None) -> ApiError:
    return ApiError(409, detail, field=field)


def problem(status: int, detail: str | None, errors: list[dict[str, str]], headers=None) -> JSONResponse:  # type: ignore[no-untyped-def]
    from http import HTTPStatus

    title = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail, "errors": errors}
    return JSONResponse(body, status_code=status, media_type=PROBLEM, headers=headers)


def _field(loc: tuple) -> str:  # type: ignore[type-arg]
    return ".".join(str(p) for p in loc)


def _unparsable_body(exc: StarletteHTTPException) -> str:
    """Why the framework could not parse a body. No route of ours answers 400: FastAPI does, with a bare
    "error parsing the body", when json.loads fails other than with a JSONDecodeError (bytes that are not
    UTF-8, nesting past the recursion limit, an integer of over 4300 digits), and Starlette does for a
    malformed multipart form. Both are invalid input, so they become a 422 on `body` like any other."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return "body is not valid UTF-8 JSON"
    if isinstance(cause, RecursionError):
        return "body is nested too deeply"
    return str(cause or exc.detail)


def http_problem(exc: StarletteHTTPException) -> JSONResponse:
    """The answer to an HTTPException, wherever it is raised (a route, or api/fastpath.py before any route)."""
    if exc.status_code == 400 and not isinstance(exc, ApiError):
        reason = _unparsable_body(exc)
        return problem(422, f"body: {reason}", [{"field": "body", "reason": reason}])
    return problem(exc.status_code, str(exc.detail), getattr(exc, "errors", []), exc.headers)


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"field": _field(e["loc"]), "reason": reason(e)} for e in exc.errors()]
        first = errors[0] if errors else {"field": "", "reason": "invalid request"}
        return problem(422, f"{first['field']}: {first['reason']}", errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_problem(exc)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return problem(500, "internal server error", [])


class BodyLimit:
    """Rejects bodies over the limit with 413 while streaming, before the app buffers them."""

    def __init__(self, app: ASGIApp, default_limit: int, large_limit: int, large_paths: re.Pattern[str]) -> None:
        self.app = app
        self.default_limit, self.large_limit, self.large_paths = default_limit, large_limit, large_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit(scope)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._reject(scope, receive, send, limit)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:  # an HTTPException: FastAPI's body parsing passes it on (any other error is a 400)
                detail = too_large(scope.get("path", ""), limit)
                raise ApiError(413, detail, field="body")
            return message

        await self.app(scope, limited, send)

    def _limit(self, scope: Scope) -> int:
        """The large limit for a PUT whose whole path is one of `large_paths` (a substring of a path its caller
        writes gave any PUT with an id named "chunks" 64 MiB, read before its token was checked)."""
        is_chunk = scope.get("method") == "PUT" and self.large_paths.fullmatch(scope.get("path", "")) is not None
        return self.large_limit if is_chunk else self.default_limit

    async def _reject(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        detail = too_large(scope.get("path", ""), limit)
        response = problem(413, detail, [{"field": "body", "reason": detail}])
        await response(scope, receive, send)


def too_large(path: str, limit: int) -> str:
    """What a 413 says: the limit in MiB, and what to do about it."""
    mib = f"{limit / 2**20:.3g} MiB"
    if path.startswith("/v1/datasets"):
        return (f"the dataset is larger than this server's limit of {mib} per request: send it in parts "
                "(POST /v1/datasets/uploads; `echo2 datasets upload` and the SDK's datasets.upload do)")
    return f"the request body is larger than this server's limit of {mib} for {path}: send less at once"
