"""Shared route dependencies as `Annotated` aliases: the session, settings and each kind of caller."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from echo2.protocol import WorkerStatus
from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from . import auth
from .db import WRITER_LOCK
from .errors import ApiError, unauthorized
from .models import Job, Provider, User, Worker
from .settings import Settings
from .storage import BlobStore

_bearer = HTTPBearer(auto_error=False, description="An Echo2 token: user API key, provider, worker or learner.")


def _db(request: Request) -> Iterator[Session]:
    with request.app.state.db.session() as session:
        yield session


def _settings(request: Request) -> Settings:
    return request.app.state.settings


def _blobs(request: Request) -> BlobStore:
    return request.app.state.blobs


def _checkpoints(request: Request) -> BlobStore:
    return request.app.state.checkpoints


SessionDep = Annotated[Session, Depends(_db)]
SettingsDep = Annotated[Settings, Depends(_settings)]
BlobsDep = Annotated[BlobStore, Depends(_blobs)]
CheckpointsDep = Annotated[BlobStore, Depends(_checkpoints)]  # the learner's own checkpoints
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
PassedFilter = Annotated[bool | None, Query(description="Only passed (true) or failed (false) audits.")]


@dataclass
class Principal:
    kind: str
    id: str
    user: User | None = None
    worker: Worker | None = None

    @property
    def is_admin(self) -> bool:
        return self.user is not None and self.user.role == "admin"


def bearer_token(creds: HTTPAuthorizationCredentials | None) -> str:
    if creds is None:
        raise unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    return creds.credentials


async def _token(creds: Credentials) -> str:
    return bearer_token(creds)


# The bearer token alone, checked for presence (401) before the body is validated; async, so no thread.
Token = Annotated[str, Depends(_token)]


def hand_back(db: Session) -> None:
    """End a dependency's read: its connection goes back to the pool before FastAPI moves on to the next
    dependency or the route, each in a pool thread of its own. Held across that hop, SQLite's one connection
    deadlocked as soon as every pool thread was waiting for it (requests hung for the pool's timeout)."""
    db.commit()


def _principal(db: SessionDep, creds: Credentials) -> Principal:
    principal = principal_of(db, bearer_token(creds))
    hand_back(db)
    return principal


def principal_of(db: Session, token: str) -> Principal:
    """Who a bearer token is (401 when nobody); for routes that must not hold a session while they wait."""
    identity = auth.lookup(db, token)
    if identity is None:
        raise unauthorized("unknown or revoked token")
    principal = Principal(kind=identity.kind, id=identity.principal_id)
    if identity.kind == "user":
        principal.user = db.get(User, identity.principal_id)
        if principal.user is None:
            raise unauthorized("this API key's user no longer exists")
    elif identity.kind == "worker":
        principal.worker = db.get(Worker, identity.principal_id)
        if principal.worker is None or principal.worker.status == WorkerStatus.deregistered:
            raise unauthorized("this worker is deregistered; register again")
    return principal


WHAT = {"user": "a user API key", "provider": "a provider token", "worker": "a worker token",
        "learner": "the job's learner token"}


def require_kind(p: Principal, kind: str) -> Principal:
    """403 unless the caller is of this kind (for routes that authenticate inside their own session)."""
    if p.kind != kind:
        raise ApiError(403, f"this route needs {WHAT[kind]}, not a {p.kind} token")
    return p


def _require(kind: str):  # type: ignore[no-untyped-def]
    def dep(p: Annotated[Principal, Depends(_principal)]) -> Principal:
        return require_kind(p, kind)

    return dep


def _user(p: Annotated[Principal, Depends(_require("user"))]) -> User:
    assert p.user is not None
    return p.user


def _admin(user: Annotated[User, Depends(_user)]) -> User:
    if user.role != "admin":
        raise ApiError(403, "this route needs an admin API key")
    return user


def _provider(db: SessionDep, p: Annotated[Principal, Depends(_require("provider"))]) -> Provider:
    provider = db.get(Provider, p.id)
    if provider is None:
        raise unauthorized("provider no longer exists")
    hand_back(db)
    return provider


def _worker(p: Annotated[Principal, Depends(_require("worker"))]) -> Worker:
    assert p.worker is not None
    return p.worker


def _learner(p: Annotated[Principal, Depends(_require("learner"))]) -> str:
    return p.id


AnyPrincipal = Annotated[Principal, Depends(_principal)]
CurrentUser = Annotated[User, Depends(_user)]
AdminUser = Annotated[User, Depends(_admin)]
CurrentProvider = Annotated[Provider, Depends(_provider)]
CurrentWorker = Annotated[Worker, Depends(_worker)]
LearnerJobId = Annotated[str, Depends(_learner)]


def owned_job(db: Session, user: User, job_id: str, *, for_update: bool = False) -> Job:
    """The job if this user may see it (owner or admin); 404 otherwise, so IDs leak nothing."""
    job = db.get(Job, job_id, with_for_update=WRITER_LOCK if for_update else None)
    if job is None or (job.owner_id != user.id and user.role != "admin"):
        raise ApiError(404, f"job {job_id} not found")
    return job


def learner_job(db: Session, token_job_id: str, job_id: str, *, for_update: bool = False) -> Job:
    if token_job_id != job_id:
        raise ApiError(403, "this learner token belongs to another job")
    job = db.get(Job, job_id, with_for_update=WRITER_LOCK if for_update else None)
    if job is None:
        raise ApiError(404, f"job {job_id} not found")
    return job
