"""Workers: activation, heartbeat replies with the desired state, and the relay tree."""

from __future__ import annotations

from echo2.protocol import Assignment, DesiredState, Heartbeat, HeartbeatReply, JobStatus
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from ..models import Job, Lease, Worker, utcnow
from ..settings import Settings
from .jobs import sampling_of, spec_of
from .pool import end_lease


def assign(worker: Worker, job: Job) -> None:
    """Activate a worker on a job (the scheduler decides which; this records it)."""
    if worker.job_id != job.id:
        worker.active_since = utcnow()
    worker.job_id, worker.desired = job.id, DesiredState.active.value


def unassign(db: Session, worker: Worker, desired: DesiredState = DesiredState.idle) -> None:
    for lease in db.scalars(select(Lease).where(Lease.worker_id == worker.id, Lease.status == "active")):
        end_lease(db, lease, "released")
    worker.job_id, worker.desired, worker.active_since = None, desired.value, None


def heartbeat(db: Session, worker: Worker, hb: Heartbeat, settings: Settings) -> HeartbeatReply:
    worker.last_heartbeat_at = utcnow()
    worker.version_held = hb.version_held
    worker.stats = hb.stats.model_dump(mode="json")
    worker.status = hb.status.value
    _flag_bad_sources(db, hb)
    job = db.get(Job, worker.job_id) if worker.job_id else None
    if job is not None and JobStatus(job.status).is_terminal():
        unassign(db, worker)
        job = None
    assignment = _assignment(db, worker, job, settings) if job is not None else None
    desired = DesiredState(worker.desired)
    if desired is DesiredState.active and assignment is None:
        desired = DesiredState.idle  # active on a job with no published version yet: wait
    return HeartbeatReply(desired=desired, assignment=assignment,
                          heartbeat_interval_s=settings.heartbeat_interval_s, server_time=utcnow())


def _flag_bad_sources(db: Session, hb: Heartbeat) -> None:
    for bad in hb.bad_sources:
        db.execute(update(Worker).where(Worker.relay_url == bad.url.rstrip("/"))
                   .values(bad_chunks=Worker.bad_chunks + 1))


def _assignment(db: Session, worker: Worker, job: Job, settings: Settings) -> Assignment | None:
    if job.status != JobStatus.running.value or job.version is None:
        return None
    spec = spec_of(job)
    return Assignment(
        job_id=job.id, version=job.version, min_version=max(0, job.step - spec.staleness),
        staleness=spec.staleness,
        manifest_url=f"{settings.public_url}/v1/jobs/{job.id}/versions/{job.version}/manifest",
        relay_parents=relay_parents(db, worker, job, settings),
        sampling=sampling_of(spec),
    )


def relay_parents(db: Session, worker: Worker, job: Job, settings: Settings) -> list[str]:
    """Base URLs to fetch chunks from, best first, the origin last.

    Relay-capable peers on the job form a k-ary tree ordered by upload bandwidth (high uplinks near
    the root, fed by the origin; k = 1 is a pipelined chain); leaves (no relay URL) hang under the
    relays by a stable hash. Peers reported bad too often are left out. A peer serves the same
    paths as the origin, so a parent is just a base URL.
    """
    peers = db.execute(
        select(Worker.id, Worker.relay_url)
        .where(Worker.job_id == job.id, Worker.status != "offline", Worker.relay_url.is_not(None),
               Worker.bad_chunks < settings.relay_max_bad_chunks)
        .order_by(Worker.upload_mbps.desc(), Worker.id)
    ).all()
    ids = [p.id for p in peers]
    k = settings.relay_fanout
    if worker.id in ids:
        i = ids.index(worker.id)
        parents = [peers[(i - 1) // k].relay_url] if i > 0 else []
    elif peers:
        parents = [peers[_stable_slot(worker.id, len(peers))].relay_url]
    else:
        parents = []
    return [p for p in parents if p] + [settings.public_url]


def _stable_slot(worker_id: str, n: int) -> int:
    return int(worker_id.rsplit("_", 1)[-1], 16) % n
