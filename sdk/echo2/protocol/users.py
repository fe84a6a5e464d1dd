"""Users, API keys and other tokens."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field

from .common import Model, Name, ReadModel, Role


class UserCreate(Model):
    name: Name
    role: Role = Role.user


class UserRead(ReadModel):
    id: str
    name: str
    role: Role
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
