"""Bearer tokens of four kinds, stored as sha256 hashes. The prefix says which kind a token is."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass

from sqlalchemy import event, select, update
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


@dataclass(frozen=True)
class Identity:
    kind: str
    principal_id: str


class _IdentityCache:
    """Valid token hash -> identity for a few seconds, so hot routes (heartbeats, leases) skip a query.
    A revocation through this process clears it at once and again once it commits; other API processes
    notice within TTL_S. Each clear starts a new generation, and an identity read from the database is
    kept only if no clear came since the read began: a request that read a token while its revocation was
    committing would otherwise have put it back, valid for TTL_S more (a fenced learner's token too)."""

    TTL_S = 5.0

    def __init__(self) -> None:
        self._entries: dict[str, tuple[float, Identity]] = {}
        self._lock = threading.Lock()
        self.generation = 0

    def get(self, digest: str) -> Identity | None:
        entry = self._entries.get(digest)
        return entry[1] if entry is not None and entry[0] > time.monotonic() else None

    def put(self, digest: str, identity: Identity, read_in: int) -> None:
        """`read_in`: the generation when the read of `identity` began."""
        with self._lock:
            if read_in != self.generation:
                return
            if len(self._entries) > 100_000:
                self._entries.clear()
            self._entries[digest] = (time.monotonic() + self.TTL_S, identity)

    def clear(self, *_: object) -> None:
        with self._lock:
            self._entries.clear()
            self.generation += 1


_cache = _IdentityCache()


def lookup(db: Session, plain: str) -> Identity | None:
    return lookup_many(db, [plain])[0]


def lookup_many(db: Session, plains: list[str]) -> list[Identity | None]:
    """Each token's identity (None: unknown or revoked), those not cached read in one query: a heartbeat
    batch of a large fleet, whose workers beat less often than the cache keeps them, is one round trip."""
    digests = [hash_token(plain) for plain in plains]
    found = {d: i for d in digests if (i := _cache.get(d)) is not None}
    missing = {d for d in digests if d not in found}
    if missing:
        generation = _cache.generation
        for row in db.execute(select(Token.hash, Token.kind, Token.principal_id)
                              .where(Token.hash.in_(missing), Token.revoked_at.is_(None))):
            found[row.hash] = identity = Identity(row.kind, row.principal_id)
            _cache.put(row.hash, identity, generation)
    return [found.get(d) for d in digests]


def forget_all() -> None:
    """Drop cached identities (after tokens or principals were changed behind this process's back)."""
    _cache.clear()


def revoke(db: Session, token: Token) -> None:
    token.revoked_at = token.revoked_at or utcnow()
    _forget_on_commit(db)


def _forget_on_commit(db: Session) -> None:
    """Clear the cache now and once the revocation commits (_IdentityCache says why both)."""
    _cache.clear()
    event.listen(db, "after_commit", _cache.clear, once=True)


def revoke_all(db: Session, kind: str, principal_id: str) -> None:
    db.execute(
        update(Token)
        .where(Token.kind == kind, Token.principal_id == principal_id, Token.revoked_at.is_(None))
        .values(revoked_at=utcnow())
    )
    _forget_on_commit(db)
