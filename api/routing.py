"""The route class of every API router: a sync route hands its database connection back when it returns.

FastAPI validates a sync route's answer in another pool thread after the route returns, and closes the
route's session only after that. A route that read without committing kept its transaction (and, on SQLite,
the process's one connection) across that hop: once every pool thread was waiting for the connection, nobody
could validate the answer that would free it, and the API stalled for the pool's timeout. Dependencies hand
theirs back themselves (`deps.hand_back`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.routing import APIRoute
from sqlalchemy import event
from sqlalchemy.orm import Session

UNSAVED = "echo2.unsaved"  # Session.info: a flush since the last commit or rollback


class Route(APIRoute):
    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if not inspect.iscoroutinefunction(endpoint):
            endpoint = _handing_back(endpoint)
        super().__init__(path, endpoint, **kwargs)


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
