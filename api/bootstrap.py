"""Creating the first admin, from the CLI or from ECHO2_BOOTSTRAP_API_KEY at start."""

from __future__ import annotations

from sqlalchemy import select

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
