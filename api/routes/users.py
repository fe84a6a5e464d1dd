"""Users and tokens: admin creates users, anyone reads themself, admin lists and revokes tokens."""

from __future__ import annotations

from typing import Annotated

from echo2.protocol import ApiKeyCreated, Quotas, TokenKind, TokenRead, UserCreate, UserCreated, UserRead
from fastapi import Query
from sqlalchemy import select

from .. import auth
from ..deps import AdminUser, CurrentUser, SessionDep
from ..errors import ApiError
from ..models import Token, User
from ..routing import make_router

router = make_router(prefix="/v1", tags=["users"])


@router.post("/users", status_code=201, operation_id="create_user", summary="Create a user with an API key (admin)")
def create_user(body: UserCreate, _: AdminUser, db: SessionDep) -> UserCreated:
    user = User(name=body.name, role=body.role.value)
    db.add(user)
    db.flush()
    _, plain = auth.issue_token(db, "user", user.id)
    db.commit()
    return UserCreated(user=UserRead.model_validate(user), api_key=plain)


@router.get("/users", operation_id="list_users", summary="List users (admin)")
def list_users(_: AdminUser, db: SessionDep) -> list[UserRead]:
    return [UserRead.model_validate(u) for u in db.scalars(select(User).order_by(User.created_at))]


@router.put("/users/{user_id}/quotas", operation_id="set_user_quotas",
            summary="Set a user's quotas (admin): concurrent jobs and $ per day; jobs beyond them wait")
def set_quotas(user_id: str, body: Quotas, _: AdminUser, db: SessionDep) -> UserRead:
    user = db.get(User, user_id)
    if user is None:
        raise ApiError(404, f"user {user_id} not found")
    user.max_concurrent_jobs, user.max_usd_per_day = body.max_concurrent_jobs, body.max_usd_per_day
    db.commit()
    return UserRead.model_validate(user)


@router.get("/me", operation_id="get_me", summary="The calling user")
def me(user: CurrentUser) -> UserRead:
    return UserRead.model_validate(user)


@router.post("/users/{user_id}/keys", status_code=201, operation_id="create_api_key",
             summary="Issue another API key for a user (the user themself or an admin)")
def create_key(user_id: str, caller: CurrentUser, db: SessionDep) -> ApiKeyCreated:
    if caller.id != user_id and caller.role != "admin":
        raise ApiError(404, f"user {user_id} not found")
    if db.get(User, user_id) is None:
        raise ApiError(404, f"user {user_id} not found")
    row, plain = auth.issue_token(db, "user", user_id)
    db.commit()
    return ApiKeyCreated(token=TokenRead.model_validate(row), api_key=plain)


@router.get("/users/{user_id}/keys", operation_id="list_api_keys",
            summary="A user's API keys, their metadata (the user themself or an admin); secrets are never shown")
def list_keys(user_id: str, caller: CurrentUser, db: SessionDep, include_revoked: bool = False) -> list[TokenRead]:
    if caller.id != user_id and caller.role != "admin":
        raise ApiError(404, f"user {user_id} not found")
    query = select(Token).where(Token.kind == "user", Token.principal_id == user_id)
    if not include_revoked:
        query = query.where(Token.revoked_at.is_(None))
    return [TokenRead.model_validate(t) for t in db.scalars(query.order_by(Token.created_at))]


@router.get("/tokens", operation_id="list_tokens", summary="List token metadata (admin); secrets are never shown")
def list_tokens(_: AdminUser, db: SessionDep, kind: TokenKind | None = None,
                include_revoked: bool = False,
                limit: Annotated[int, Query(ge=1, le=1000)] = 200) -> list[TokenRead]:
    query = select(Token)
    if kind is not None:
        query = query.where(Token.kind == kind.value)
    if not include_revoked:
        query = query.where(Token.revoked_at.is_(None))
    return [TokenRead.model_validate(t) for t in db.scalars(query.order_by(Token.created_at).limit(limit))]


@router.delete("/tokens/{token_id}", status_code=204, operation_id="revoke_token",
               summary="Revoke a token: any (admin), or one of the caller's own API keys (a leaked key, a rotation)",
               responses={409: {"description": "It is the caller's last API key: create another first."}})
def revoke_token(token_id: str, caller: CurrentUser, db: SessionDep) -> None:
    token = db.get(Token, token_id)
    own = token is not None and token.kind == "user" and token.principal_id == caller.id
    if token is None or not (own or caller.role == "admin"):  # another's answers as an unknown one
        raise ApiError(404, f"token {token_id} not found")
    if own:
        db.get(User, caller.id, with_for_update=True)  # two revocations at once each saw the other key live
        if _last_key(db, caller.id, token.id):
            raise ApiError(409, "refusing to revoke your last API key: create another first "
                                "(POST /v1/users/{id}/keys)")
    auth.revoke(db, token)
    db.commit()


def _last_key(db: SessionDep, user_id: str, token_id: str) -> bool:
    others = db.scalars(select(Token.id).where(Token.kind == "user", Token.principal_id == user_id,
                                               Token.revoked_at.is_(None), Token.id != token_id))
    return others.first() is None
