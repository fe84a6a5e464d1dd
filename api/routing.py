"""The route class of every API router: a sync route hands its database connection back when it returns, a
JSON body is validated straight from its bytes, and a path parameter holding a NUL byte is refused.

FastAPI validates a sync route's answer in another pool thread after the route returns, and closes the
route's session only after that. A route that read without committing kept its transaction (and, on SQLite,
the process's one connection) across that hop: once every pool thread was waiting for the connection, nobody
could validate the answer that would free it, and the API stalled for the pool's timeout. Dependencies hand
theirs back themselves (`deps.hand_back`).

FastAPI parses a JSON body into Python objects (`json.loads`) and then validates those against the body's model;
pydantic validates the same bytes in one pass several times faster, which counts for a worker's rollout submission
(16 groups, ~230 KB: docs/BENCHMARKS.md "Bodies validated from their bytes"). `ModelBody` hands FastAPI the model
validated from the bytes, which it takes as it is (a model instance passes validation unchanged). A body the
one-pass validation refuses goes the old way, so every error answer is the one FastAPI always gave.

PostgreSQL text cannot hold NUL, so a route looking up an id with one in it (a pasted id with a stray `%00`) failed
with a 500 where any other unknown id is its 404. No id, name or file has a NUL in it, and body fields refuse one
(`NoNul`, echo2.protocol.common); checked here, every route's path parameters do too, with the 422 naming them
that a malformed body field gets, and a route added later needs nothing of its own."""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from sqlalchemy import event
from sqlalchemy.orm import Session
from starlette.types import Receive, Scope

UNSAVED = "echo2.unsaved"  # Session.info: a flush since the last commit or rollback


class Route(APIRoute):
    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if not inspect.iscoroutinefunction(endpoint):
            endpoint = _handing_back(endpoint)
        super().__init__(path, endpoint, **kwargs)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = _body_model(self)

        async def checked(request: Request) -> Response:
            _refuse_nul(request.path_params)
            return await handler(request if model is None else ModelBody(request.scope, request.receive, model))

        return checked


def _refuse_nul(params: dict[str, Any]) -> None:
    """422 on each path parameter with a NUL byte in it (the path's values, before FastAPI converts them)."""
    errors = [{"type": "value_error", "loc": ("path", name), "msg": "must not contain NUL (\\x00) characters",
               "input": value} for name, value in params.items() if "\x00" in value]
    if errors:
        raise RequestValidationError(errors)


class ModelBody(Request):
    """A request whose JSON body reads as its route's model, validated from the bytes; a body that model refuses
    reads as parsed JSON, for FastAPI to validate and answer as ever (status, error locations and messages)."""

    def __init__(self, scope: Scope, receive: Receive, model: type[BaseModel]) -> None:
        super().__init__(scope, receive)
        self.model = model

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = self.model.model_validate_json(body)
            except ValidationError:
                self._json = json.loads(body)
        return self._json


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    """The model a route's whole JSON body is (one body parameter, not embedded), or None."""
    field = route.body_field
    if field is None or route._embed_body_fields:
        return None
    model = field.field_info.annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def make_router(**kwargs: Any) -> APIRouter:
    """An APIRouter whose routes are `Route`s."""
    return APIRouter(route_class=Route, **kwargs)


def _handing_back(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(endpoint)  # FastAPI reads the parameters through __wrapped__
    def call(*args: Any, **kwargs: Any) -> Any:
        answer = endpoint(*args, **kwargs)
        for value in kwargs.values():
            if isinstance(value, Session):
                _end_read(value)
        return answer

    return call


def _end_read(db: Session) -> None:
    """End the transaction a route left open: commit a read (nothing flushed or pending, so nothing is written,
    and with expire_on_commit off the answer's objects stay loaded); roll back writes the route did not commit,
    as the session's close would have."""
    if not db.in_transaction():
        return
    if db.info.get(UNSAVED) or db.new or db.dirty or db.deleted:
        db.rollback()
    else:
        db.commit()


@event.listens_for(Session, "after_flush")
def _flushed(session: Session, _context: Any) -> None:
    session.info[UNSAVED] = True


@event.listens_for(Session, "after_commit")
@event.listens_for(Session, "after_rollback")
def _ended(session: Session) -> None:
    session.info.pop(UNSAVED, None)
