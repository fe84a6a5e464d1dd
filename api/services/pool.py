"""The prompt pool: server-chosen leases, renewals, expiry and returning prompts. Nothing is lost:
every prompt is always available, leased, submitted or trained."""

from __future__ import annotations

from datetime import datetime, timedelta

from echo2.seeds import order_key, prompt_seed
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from ..errors import ApiError
from ..models import Job, Lease, Prompt, Worker, utcnow
from .jobs import spec_of


def return_prompts(db: Session, prompt_ids: list[int], lease_id: str | None = None,
                   from_state: str = "leased") -> int:
    """Put prompts back into the pool (one more attempt each): by default leased ones that got no
    accepted rollout; `from_state="submitted"` for ones whose queued rollout was rejected later."""
    if not prompt_ids:
        return 0
    query = update(Prompt).where(Prompt.id.in_(prompt_ids), Prompt.state == from_state)
    if lease_id is not None:
        query = query.where(Prompt.lease_id == lease_id)
    result = db.execute(query.values(state="available", lease_id=None, attempts=Prompt.attempts + 1))
    return result.rowcount or 0


def end_lease(db: Session, lease: Lease, status: str) -> int:
    """Close a lease; its prompts that got no rollout go back to the pool. Returns how many did."""
    lease.status, lease.finished_at = status, utcnow()
    return return_prompts(db, list(lease.prompt_ids), lease_id=lease.id)


def expire_leases(db: Session, now: datetime | None = None, job_id: str | None = None) -> int:
    """Expire active leases past their deadline. Returns the number of prompts returned."""
    now = now or utcnow()
    query = select(Lease).where(Lease.status == "active", Lease.expires_at < now)
    if job_id is not None:
        query = query.where(Lease.job_id == job_id)
    return sum(end_lease(db, lease, "expired") for lease in db.scalars(query.with_for_update(skip_locked=True)))


def create_lease(db: Session, job: Job, worker: Worker, max_prompts: int, version: int, ttl_s: float) -> Lease:
    spec = spec_of(job)
    _check_version(job, version, spec.staleness)
    expire_leases(db, job_id=job.id)
    chosen = _take_available(db, job, max_prompts)
    if not chosen and _start_next_epoch(db, job, spec.seed):
        chosen = _take_available(db, job, max_prompts)
    if not chosen:
        raise ApiError(409, "no prompts available right now: all are leased or awaiting training; retry later",
                       headers={"Retry-After": "1"})
    lease = Lease(job_id=job.id, worker_id=worker.id, version=version, step_at_lease=job.step,
                  prompt_ids=[p.id for p in chosen], expires_at=utcnow() + timedelta(seconds=ttl_s))
    db.add(lease)
    db.flush()
    db.execute(update(Prompt).where(Prompt.id.in_(lease.prompt_ids)).values(state="leased", lease_id=lease.id))
    return lease


def _check_version(job: Job, version: int, staleness: int) -> None:
    if job.version is None or version > job.version:
        raise ApiError(409, f"version {version} is not published; the latest is {job.version}", field="version")
    if version < job.step - staleness:  # JobSpec.oldest_admissible
        raise ApiError(
            409, f"version {version} is too stale for step {job.step} (S={staleness}): "
            f"fetch version {job.version} first", field="version")


def _take_available(db: Session, job: Job, limit: int) -> list[Prompt]:
    # Pure function of the job's state: lowest (epoch, seeded order key) first. On PostgreSQL,
    # SKIP LOCKED lets concurrent claimers take disjoint rows; on SQLite the transaction holds the lock.
    query = (
        select(Prompt)
        .where(Prompt.job_id == job.id, Prompt.state == "available")
        .order_by(Prompt.epoch, Prompt.order_key)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return list(db.scalars(query))


def _start_next_epoch(db: Session, job: Job, seed: int) -> bool:
    """When every prompt has been trained on, the pool starts over in a new seeded order."""
    busy = db.scalar(select(func.count()).where(Prompt.job_id == job.id, Prompt.state != "trained"))
    if busy:
        return False
    prompts = list(db.scalars(select(Prompt).where(Prompt.job_id == job.id).with_for_update()))
    for p in prompts:
        p.epoch += 1
        p.state = "available"
        p.order_key = order_key(seed, job.id, p.index, p.epoch)
    return bool(prompts)


def leased_prompts(db: Session, lease: Lease, job: Job) -> list[dict[str, object]]:
    spec = spec_of(job)
    prompts = db.scalars(select(Prompt).where(Prompt.id.in_(lease.prompt_ids)).order_by(Prompt.epoch, Prompt.order_key))
    return [
        {"prompt_id": p.id, "text": p.text, "seed": prompt_seed(spec.seed, job.id, p.index, p.epoch)}
        for p in prompts
    ]
