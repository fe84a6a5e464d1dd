"""The cost ledger: providers' statements (JSON or CSV), a job's ledger for its owner, and a user's
Tinker ledger (api/tinker/usage.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from echo2.protocol import JobLedger, ProviderStatement
from echo2.protocol.tinker import TinkerUsage
from fastapi import Query, Request, Response
from sqlalchemy.orm import Session

from ..deps import AnyPrincipal, CurrentProvider, CurrentUser, Principal, SessionDep, owned_job
from ..errors import ApiError
from ..models import Provider
from ..routing import make_router
from ..services import ledger
from ..tinker import usage

router = make_router(prefix="/v1", tags=["ledger"])
Since = Annotated[datetime | None, Query(description="Entries made at or after this time (ISO 8601; UTC when "
                                         "it has no offset).")]
Until = Annotated[datetime | None, Query(description="Entries made before this time (ISO 8601; UTC when it has "
                                         "no offset).")]
Format = Annotated[Literal["json", "csv"] | None, Query(description="`csv`: the page of entries as CSV with a "
                                                        "header row (`Accept: text/csv` chooses it too).")]
EntryLimit = Annotated[int, Query(ge=1, le=10_000, description="Entries per page (totals cover them all).")]
Offset = Annotated[int, Query(ge=0, le=10_000_000, description="Entries to skip.")]
CSV_OR_JSON: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/csv": {"schema": {"type": "string"}}},
          "description": "The statement; as CSV with `format=csv` or `Accept: text/csv`."}}


@router.get("/providers/me/statement", operation_id="get_my_statement", response_model=ProviderStatement,
            responses=CSV_OR_JSON, summary="The calling provider's ledger entries and totals per worker and job")
def my_statement(provider: CurrentProvider, db: SessionDep, request: Request, since: Since = None,
                 until: Until = None, format: Format = None, limit: EntryLimit = 1000, offset: Offset = 0) -> Any:
    return _statement(db, provider, request, since, until, format, limit, offset)


@router.get("/providers/{provider_id}/statement", operation_id="get_provider_statement",
            response_model=ProviderStatement, responses=CSV_OR_JSON,
            summary="A provider's ledger entries and totals (admin, or the provider itself)")
def provider_statement(provider_id: str, p: AnyPrincipal, db: SessionDep, request: Request, since: Since = None,
                       until: Until = None, format: Format = None, limit: EntryLimit = 1000,
                       offset: Offset = 0) -> Any:
    return _statement(db, _readable(db, p, provider_id), request, since, until, format, limit, offset)


@router.get("/jobs/{job_id}/ledger", operation_id="get_job_ledger",
            summary="What a job cost, entry by entry, with totals by kind that sum to its cost")
def job_ledger(job_id: str, user: CurrentUser, db: SessionDep, limit: EntryLimit = 1000,
               offset: Offset = 0) -> JobLedger:
    return ledger.job_ledger(db, owned_job(db, user, job_id), limit, offset)


@router.get("/tinker/usage", operation_id="get_tinker_usage",
            summary="What the caller's Tinker API requests cost, entry by entry, with totals by session, model "
                    "and kind")
def tinker_usage(user: CurrentUser, db: SessionDep,
                 session_id: Annotated[str | None, Query(max_length=40, pattern=r"^[A-Za-z0-9_]+$",
                                                         description="Only this Tinker session's entries "
                                                         "(`ServiceClient`'s session id).")] = None,
                 limit: EntryLimit = 1000, offset: Offset = 0) -> TinkerUsage:
    return usage.usage(db, user.id, session_id, limit, offset)


def _statement(db: Session, provider: Provider, request: Request, since: datetime | None,
               until: datetime | None, format: str | None, limit: int, offset: int) -> Any:
    since, until = _utc(since, "since"), _utc(until, "until")
    if since is not None and until is not None and until <= since:
        raise ApiError(422, "until must be later than since", field="until")
    result = ledger.statement(db, provider, since, until, limit, offset)
    if format == "csv" or (format is None and "text/csv" in request.headers.get("accept", "")):
        return Response(ledger.to_csv(result.entries), media_type="text/csv; charset=utf-8",
                        headers={"Content-Disposition": f'attachment; filename="statement-{provider.id}.csv"'})
    return result


def _utc(when: datetime | None, field: str) -> datetime | None:
    if when is None:
        return None
    try:
        return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)
    except OverflowError:  # e.g. 0001-01-01T00:00+01:00, before the first representable instant
        raise ApiError(422, f"{field} is out of range", field=field) from None


def _readable(db: Session, p: Principal, provider_id: str) -> Provider:
    """The provider if the caller may read its money: an admin, or the provider itself. Another provider
    gets a 404, as if it did not exist."""
    if not p.is_admin and p.kind != "provider":
        raise ApiError(403, "a provider's statement is for the provider and admins")
    provider = db.get(Provider, provider_id) if p.is_admin or p.id == provider_id else None
    if provider is None:
        raise ApiError(404, f"provider {provider_id} not found")
    return provider
