"""Bearer tokens of four kinds, stored as sha256 hashes. The prefix says which kind a token is."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from .models import Token, utcnow

PREFIXES = {"user": "e2u_", "provider": "e2p_", "worker": "e2w_", "learner": "e2l_"}


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def issue_token(db: Session, kind: str, principal_id: str) -> tuple[Token, str]:
    """Create a token row and return it with the plaintext, which is never stored."""
    plain = PREFIXES[kind] + secrets.token_urlsafe(32)
    row = Token(hash=hash_token(plain), kind=kind, principal_id=principal_id, prefix=plain[:10])
    db.add(row)
    return row, plain


def adopt_token(db: Session, kind: str, principal_id: str, plain: str) -> Token:
    """Register a caller-chosen token (the bootstrap admin key) if it is not known yet."""
    existing = db.scalar(select(Token).where(Token.hash == hash_token(plain)))
    if existing is not None:
        return existing
    row = Token(hash=hash_token(plain), kind=kind, principal_id=principal_id, prefix=plain[:10])
    db.add(row)
    return row


def lookup(db: Session, plain: str) -> Token | None:
    row = db.scalar(select(Token).where(Token.hash == hash_token(plain)))
    if row is None or row.revoked_at is not None:
        return None
    return row


def revoke_all(db: Session, kind: str, principal_id: str) -> None:
    db.execute(
        update(Token)
        .where(Token.kind == kind, Token.principal_id == principal_id, Token.revoked_at.is_(None))
        .values(revoked_at=utcnow())
    )
