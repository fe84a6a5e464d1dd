"""Providers and workers: sign-up, registration, heartbeat (desired state), deregistration."""

from __future__ import annotations

from typing import Annotated

from echo2.protocol import (
    AuditRead,
    DesiredState,
    Heartbeat,
    HeartbeatReply,
    Page,
    PlacementLine,
    ProviderCreate,
    ProviderCreated,
    ProviderRead,
    TrustState,
    WorkerRead,
    WorkerRegister,
    WorkerRegistered,
    WorkerStatus,
)
from fastapi import Query, Request, Response
from sqlalchemy import func, or_, select

from .. import auth
from ..deps import (
    AdminUser,
    AnyPrincipal,
    Credentials,
    CurrentProvider,
    PassedFilter,
    Principal,
    SessionDep,
    SettingsDep,
    Token,
)
from ..errors import ApiError, unauthorized
from ..models import Audit, Decision, Job, Lease, Provider, User, Worker
from ..routing import make_router
from ..services import fleet, relay, trust

router = make_router(prefix="/v1", tags=["fleet"])


@router.post("/providers", status_code=201, operation_id="create_provider",
             summary="Sign up a GPU provider (admin, or anyone when open registration is on)")
def create_provider(body: ProviderCreate, db: SessionDep, settings: SettingsDep, creds: Credentials) -> ProviderCreated:
    if creds is None and not settings.open_provider_registration:
        raise ApiError(401, "provider sign-up needs an admin API key (open registration is off)",
                       headers={"WWW-Authenticate": "Bearer"})
    if creds is not None:
        identity = auth.lookup(db, creds.credentials)
        if identity is None:  # a mistyped key is not a question of rights
            raise unauthorized("unknown or revoked token")
        if identity.kind != "user" or _role(db, identity.principal_id) != "admin":
            raise ApiError(403, "only an admin can sign providers up")
    provider = Provider(name=body.name, contact=body.contact)
    db.add(provider)
    db.flush()
    _, plain = auth.issue_token(db, "provider", provider.id)
    db.commit()
    return ProviderCreated(provider=_provider_read(db, provider), token=plain)


@router.get("/providers", operation_id="list_providers", summary="List providers (admin)")
def list_providers(_: AdminUser, db: SessionDep) -> list[ProviderRead]:
    return [_provider_read(db, p) for p in db.scalars(select(Provider).order_by(Provider.created_at))]


@router.get("/providers/me", operation_id="get_my_provider", summary="The calling provider, with earnings")
def my_provider(provider: CurrentProvider, db: SessionDep) -> ProviderRead:
    return _provider_read(db, provider)


@router.post("/workers", status_code=201, operation_id="register_worker", summary="Register a worker (provider token)")
def register_worker(body: WorkerRegister, provider: CurrentProvider, db: SessionDep,
                    settings: SettingsDep) -> WorkerRegistered:
    if body.relay_url and settings.env == "production":
        relay.check_public_url(body.relay_url)
    # Read under the provider's lock, which a ban holds: a worker registered while its provider was being banned
    # was a worker in probation under a banned provider.
    db.refresh(provider, with_for_update=True)
    if provider.banned_at is not None:
        raise ApiError(403, f"this provider is banned and registers no more workers: {provider.standing_reason}")
    data = body.model_dump(mode="json", exclude={"relay_url"})
    on_watch = trust.on_watch(provider)
    probation = TrustState.probation if settings.probation_audits or on_watch else TrustState.trusted
    worker = Worker(provider_id=provider.id, relay_url=body.relay_url.rstrip("/") if body.relay_url else None,
                    status=WorkerStatus.idle, desired=DesiredState.idle, stats={}, trust=probation,
                    **data)
    db.add(worker)
    db.flush()
    trust.inherit_strikes(db, worker)
    _, plain = auth.issue_token(db, "worker", worker.id)
    db.commit()
    return WorkerRegistered(worker=WorkerRead.model_validate(worker), token=plain,
                            heartbeat_interval_s=settings.heartbeat_interval_s, lease_ttl_s=settings.lease_ttl_s)


@router.get("/workers", operation_id="list_workers",
            summary="Workers you can see: all (admin), yours (provider), or those on your jobs (user)")
def list_workers(p: AnyPrincipal, db: SessionDep, settings: SettingsDep, status: WorkerStatus | None = None,
                 job_id: Annotated[str | None, Query(max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")] = None,
                 include_deregistered: Annotated[bool, Query(
                     description="false leaves deregistered workers out: a provider's machines now, those its "
                                 "`num_workers` counts (each restart of `echo2-worker join` registers a new one).")
                 ] = True,
                 limit: Annotated[int, Query(ge=1, le=500)] = 100,
                 offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0) -> Page[WorkerRead]:
    query = _visible(select(Worker), p)
    if status is not None:
        query = query.where(Worker.status == status)
    if not include_deregistered:
        query = query.where(Worker.status != WorkerStatus.deregistered)
    if job_id is not None:
        query = query.where(Worker.job_id == job_id)
    total = db.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = db.scalars(query.order_by(Worker.created_at, Worker.id).limit(limit).offset(offset))
    items = trust.worker_reads(db, list(rows), settings, admin=p.is_admin, user_id=_user(p))
    nxt = offset + len(items) if offset + len(items) < total else None
    return Page[WorkerRead](items=items, total=total, next_offset=nxt)


@router.get("/workers/{worker_id}", operation_id="get_worker", summary="Get a worker")
def get_worker(worker_id: str, p: AnyPrincipal, db: SessionDep, settings: SettingsDep) -> WorkerRead:
    return trust.worker_reads(db, [_visible_worker(db, p, worker_id)], settings, admin=p.is_admin,
                              user_id=_user(p))[0]


@router.get("/workers/{worker_id}/placement", operation_id="get_worker_placement",
            summary="Why the scheduler has this worker where it is: its newest decision on each job it weighed the "
                    "worker for, newest first",
            description="Visible to the worker itself, its provider and admins. An idle worker's lines say what it "
                        "misses for each job (memory, backend, freshness, a measured throughput) or that it is not "
                        "needed; `echo2-worker status` prints them.")
def get_worker_placement(worker_id: str, p: AnyPrincipal, db: SessionDep,
                         limit: Annotated[int, Query(ge=1, le=50)] = 5) -> list[PlacementLine]:
    worker = _visible_worker(db, p, worker_id)
    if not _its_own(p):  # its lines name the other jobs it serves or was weighed for
        raise ApiError(403, "a worker's placement is for the worker, its provider and admins")
    job = func.coalesce(Decision.job_id, "")
    newest = (select(job.label("job"), func.max(Decision.decided_at).label("at"))
              .where(Decision.worker_id == worker.id).group_by(job).subquery())
    rows = db.scalars(select(Decision).join(newest, (job == newest.c.job) & (Decision.decided_at == newest.c.at))
                      .where(Decision.worker_id == worker.id).order_by(Decision.decided_at.desc()).limit(limit))
    return [PlacementLine(job_id=d.job_id, action=str(d.action), line=d.line, decided_at=d.decided_at) for d in rows]


@router.post("/workers/{worker_id}/heartbeat", operation_id="worker_heartbeat", response_model=HeartbeatReply,
             summary="Report liveness and progress; the reply says what to do next",
             description="Needs the worker's own token. Heartbeats are committed in small group commits "
                         "(one transaction for those arriving together); the reply comes after the commit.")
async def heartbeat(worker_id: str, body: Heartbeat, token: Token, request: Request) -> Response:
    reply = await request.app.state.heartbeats.submit(token, worker_id, body)
    # Serialised here, once: the reply is built from our own model, so re-validating it is waste.
    return Response(reply.model_dump_json(), media_type="application/json")


@router.get("/workers/{worker_id}/audits", operation_id="list_worker_audits",
            summary="The learner's audits of this worker's groups, newest first: the evidence behind its trust",
            description="Visible to the worker itself, its provider and admins. A trusted worker's groups are "
                        "audited one in each window of 1/audit_rate groups: a passed audit of the window still "
                        "open shows (here and in `audits_passed`) once the window closes, as it would tell which "
                        "of the window's other groups go unaudited.")
def list_worker_audits(worker_id: str, p: AnyPrincipal, db: SessionDep, settings: SettingsDep,
                       passed: PassedFilter = None,
                       limit: Annotated[int, Query(ge=1, le=500)] = 100) -> list[AuditRead]:
    worker = _visible_worker(db, p, worker_id)
    if not _its_own(p):
        raise ApiError(403, "a worker's audits are for the worker, its provider and admins")
    query = select(Audit).where(Audit.worker_id == worker.id) if p.is_admin else trust.shown_audits(worker, settings)
    return trust.audit_reads(db, query, passed, limit)


@router.delete("/workers/{worker_id}", status_code=204, operation_id="deregister_worker",
               summary="Deregister a worker (itself, its provider or an admin); its leases are released")
def deregister(worker_id: str, p: AnyPrincipal, db: SessionDep) -> None:
    worker = _visible_worker(db, p, worker_id)
    if not _its_own(p):
        raise ApiError(403, "only the worker, its provider or an admin can deregister it")
    fleet.unassign(db, worker, DesiredState.drain)
    worker.status = WorkerStatus.deregistered
    auth.revoke_all(db, "worker", worker.id)
    db.commit()


def _user(p: Principal) -> str | None:
    """The user reading, whose view of a worker leaves other tenants out (trust.worker_reads)."""
    return p.id if p.kind == "user" else None


def _visible(query, p: Principal):  # type: ignore[no-untyped-def]
    if p.is_admin:
        return query
    if p.kind == "provider":
        return query.where(Worker.provider_id == p.id)
    if p.kind == "worker":
        return query.where(Worker.id == p.id)
    if p.kind == "user":
        return query.where(Worker.job_id.in_(select(Job.id).where(Job.owner_id == p.id)))
    return query.where(Worker.job_id == p.id)  # learner: the workers on its job


def _its_own(p: Principal) -> bool:
    """The worker itself, its provider or an admin (with _visible_worker): not a tenant whose job it served, nor
    the learner of the job it serves, whose token is for that job."""
    return p.is_admin or p.kind in ("worker", "provider")


def _visible_worker(db: SessionDep, p: Principal, worker_id: str) -> Worker:
    query = select(Worker).where(Worker.id == worker_id)
    worker = db.scalar(_visible(query, p) if p.kind != "user" or p.is_admin else query.where(_worked_for(p.id)))
    if worker is None:
        raise ApiError(404, f"worker {worker_id} not found")
    return worker


def _worked_for(user_id: str):  # type: ignore[no-untyped-def]
    """A worker one of the user's jobs has had: assigned now, or earlier (it leased its prompts), or weighed for
    it by the scheduler (its decisions, which the job's page links to). The list (`_visible`) is of those
    serving the user's jobs now."""
    owned = select(Job.id).where(Job.owner_id == user_id)
    return or_(Worker.job_id.in_(owned), Worker.id.in_(select(Lease.worker_id).where(Lease.job_id.in_(owned))),
               Worker.id.in_(select(Decision.worker_id).where(Decision.job_id.in_(owned))))


def _role(db: SessionDep, user_id: str) -> str | None:
    user = db.get(User, user_id)
    return user.role if user else None


def _provider_read(db: SessionDep, provider: Provider) -> ProviderRead:
    n = db.scalar(select(func.count()).where(Worker.provider_id == provider.id,
                                             Worker.status != WorkerStatus.deregistered)) or 0
    return ProviderRead(id=provider.id, name=provider.name, contact=provider.contact, num_workers=n,
                        earnings_usd=provider.earnings_usd, watch_until=provider.watch_until,
                        banned_at=provider.banned_at, standing_reason=provider.standing_reason,
                        created_at=provider.created_at)
