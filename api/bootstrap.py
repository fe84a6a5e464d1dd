"""Creating the first admin, from the CLI or from ECHO2_BOOTSTRAP_API_KEY at start."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import func, select

from . import auth
from .db import Database
from .models import Token, User


def create_user(db: Database, name: str, role: str = "admin") -> tuple[User, str]:
    with db.session() as s:
        user = User(name=name, role=role)
        s.add(user)
        s.flush()
        _, plain = auth.issue_token(s, "user", user.id)
        s.commit()
        return user, plain


def ensure_admin(db: Database, api_key: str) -> None:
    """Idempotent: the key maps to an admin after this, whatever was there before."""
    with db.session() as s:
        token = s.scalar(select(Token).where(Token.hash == auth.hash_token(api_key)))
        if token is None:
            user = User(name="admin", role="admin")
            s.add(user)
            s.flush()
            auth.adopt_token(s, "user", user.id, api_key)
        s.commit()


def first_run_admin(db: Database, data_dir: Path) -> Path | None:
    """On a database without users, create an admin and save its key (mode 0600) in the data dir."""
    with db.session() as s:
        if s.scalar(select(func.count()).select_from(User)):
            return None
    _, key = create_user(db, "admin", "admin")
    path = data_dir / "admin.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
    return path
