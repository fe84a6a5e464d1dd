"""Users, API keys and other tokens."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field

from .common import Model, Name, ReadModel, Role


class UserCreate(Model):
    name: Name
    role: Role = Role.user


class Quotas(Model):
    """Limits on a user's jobs (null: none). Jobs beyond them wait in the queue instead of failing."""

    max_concurrent_jobs: int | None = Field(None, ge=1, le=10_000, description="Jobs of this user holding a "
                                            "learner at once; more wait in line.")
    max_usd_per_day: float | None = Field(None, ge=0, le=1_000_000, description="$ the user's jobs and Tinker "
                                          "usage may spend in any 24 hours; at it, their running jobs pause and "
                                          "Tinker requests are refused (402) until the day's spending rolls off.")


class UserRead(ReadModel):
    id: str
    name: str
    role: Role
    max_concurrent_jobs: int | None = None
    max_usd_per_day: float | None = None
    created_at: datetime


class UserCreated(ReadModel):
    user: UserRead
    api_key: str = Field(description="API key (shown once).")


class TokenKind(StrEnum):
    user = "user"
    provider = "provider"
    worker = "worker"
    learner = "learner"


class TokenRead(ReadModel):
    id: str
    kind: TokenKind
    principal_id: str
    prefix: str = Field(description="First characters of the token, to recognise it.")
    created_at: datetime
    revoked_at: datetime | None


class ApiKeyCreated(ReadModel):
    token: TokenRead
    api_key: str
