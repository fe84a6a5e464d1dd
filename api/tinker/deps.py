"""Who is calling: the Tinker SDK sends `X-API-Key: tml-<key>` (it refuses keys without that prefix), so an
Echo2 user API key `e2u_...` is given to it as `TINKER_API_KEY=tml-e2u_...`. A plain
`Authorization: Bearer e2u_...` works too (curl, the learner host)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy.orm import Session

from ..deps import Credentials, SessionDep, hand_back, principal_of, require_kind
from ..errors import ApiError, unauthorized
from ..models import User
from ..services.notices import Announcer

TINKER_PREFIX = "tml-"


def api_key_of(x_api_key: str | None, creds: Credentials) -> str:
    if x_api_key:
        if not x_api_key.startswith(TINKER_PREFIX):
            raise unauthorized("X-API-Key must be 'tml-' followed by an Echo2 user API key (tml-e2u_...)")
        return x_api_key.removeprefix(TINKER_PREFIX)
    if creds is not None:
        return creds.credentials
    raise unauthorized("missing credentials: set TINKER_API_KEY=tml-<your Echo2 API key>")


def user_of(db: Session, token: str) -> User:
    principal = require_kind(principal_of(db, token), "user")
    assert principal.user is not None
    return principal.user


def _tinker_key(creds: Credentials, x_api_key: Annotated[str | None, Header(max_length=512)] = None) -> str:
    return api_key_of(x_api_key, creds)


def _tinker_user(db: SessionDep, key: Annotated[str, Depends(_tinker_key)]) -> User:
    user = user_of(db, key)
    hand_back(db)
    return user


def require_host(user: User) -> User:
    if user.role != "admin":
        raise ApiError(403, "a Tinker learner host authenticates with an admin API key")
    return user


def _host_user(user: Annotated[User, Depends(_tinker_user)]) -> User:
    return require_host(user)


def _announcer(request: Request) -> Announcer:
    return request.app.state.announcer


def _idempotency_key(x_idempotency_key: Annotated[str | None, Header(max_length=128)] = None) -> str | None:
    """The SDK sends one per logical POST and reuses it on retries: a retried call is the same future."""
    return x_idempotency_key


ApiKey = Annotated[str, Depends(_tinker_key)]  # checked for presence only: long polls authenticate per round
TinkerUser = Annotated[User, Depends(_tinker_user)]
HostUser = Annotated[User, Depends(_host_user)]
Bell = Annotated[Announcer, Depends(_announcer)]  # wakes hosts waiting for work, and pollers of a future
IdempotencyKey = Annotated[str | None, Depends(_idempotency_key)]
