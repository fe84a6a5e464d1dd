"""Workers: activation, what an active worker is told (assignment, relay tree), bad-source flags."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from echo2.protocol import Assignment, Challenge, DesiredState, JobStatus, LeaseStatus, WorkerStatus
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..models import Job, Lease, Worker, utcnow
from ..settings import Settings
from . import versions
from .jobs import sampling_of, spec_of
from .pool import end_lease


def assign(db: Session, worker: Worker, job: Job, settings: Settings) -> None:
    """Activate a worker on a job (the scheduler decides which; this records it). A move ends the worker's leases
    on the job it leaves and starts a new audit window (its windows number its groups on every job): a worker that
    learned where its window's audit fell on one job (its owner sees the job's audits at once; or a lease kept
    there, spent a group at a time) could otherwise forge the rest of that window on the job it serves now."""
    if worker.job_id != job.id:
        _end_leases(db, worker)
        worker.active_since = utcnow()
        window = settings.audit_window  # in SQL: a submission numbering groups meanwhile is not undone
        worker.groups_numbered = Worker.groups_numbered + (window - Worker.groups_numbered % window) % window
    worker.job_id, worker.desired = job.id, DesiredState.active


def _end_leases(db: Session, worker: Worker) -> None:
    for lease in db.scalars(select(Lease).where(Lease.worker_id == worker.id, Lease.status == LeaseStatus.active)):
        end_lease(db, lease, LeaseStatus.released)


def unassign(db: Session, worker: Worker, desired: DesiredState = DesiredState.idle) -> None:
    _end_leases(db, worker)
    worker.job_id, worker.desired, worker.active_since = None, desired, None


def assignment_for(db: Session, job: Job,
                   settings: Settings) -> Callable[[list[str], set[int], list[Challenge]], Assignment] | None:
    """What every worker active on `job` is told, given its relay parents, the versions it holds and those
    it must prove it holds (services/possession.py); None before version 0."""
    if job.status != JobStatus.running or job.version is None:
        return None
    spec, target = spec_of(job), job.version
    forms, base_url = versions.stored_forms(db, job.id), f"{settings.public_url}/v1/jobs/{job.id}"
    fields = dict(job_id=job.id, version=target, min_version=spec.oldest_admissible(job.step),
                  staleness=spec.staleness, sampling=sampling_of(spec), relay_key=relay_key(job, target),
                  lora_rank=spec.lora.rank if spec.lora else None)
    return lambda parents, held, challenges: Assignment(
        relay_parents=parents, fetch=versions.fetch_steps(forms, target, held, base_url), challenges=challenges,
        **fields)


def relay_key(job: Job, version: int) -> str:
    """The credential for `version`'s chunks on relay peers. Only workers told to hold that version
    learn it, so a worker that left the job (or anyone who found a relay port) cannot read later ones."""
    return hmac.new(bytes.fromhex(job.relay_secret), f"version:{version}".encode(), hashlib.sha256).hexdigest()


class RelayTree:
    """Base URLs to fetch chunks from, best first, the origin last.

    Relay-capable peers on the job form a k-ary tree ordered by the upload rate other providers'
    workers measured from them (high uplinks near the root, fed by the origin; unmeasured peers after
    the measured ones; k = 1 is a pipelined chain); leaves (no relay URL) hang under the relays by a
    stable hash. Peers reported bad by enough providers, or confirmed bad by the control plane, are
    left out (services/relay.py). A peer serves the same paths as the origin, so a parent is just a
    base URL.
    """

    def __init__(self, db: Session, job_id: str, settings: Settings) -> None:
        self.peers: list[tuple[str, str]] = [tuple(row) for row in db.execute(  # type: ignore[misc]
            select(Worker.id, Worker.relay_url)
            .where(Worker.job_id == job_id, Worker.status != WorkerStatus.offline, Worker.relay_url.is_not(None),
                   Worker.bad_chunks < settings.relay_max_bad_chunks, Worker.relay_confirmed_bad_at.is_(None))
            .order_by(Worker.measured_upload_mbps.is_(None), Worker.measured_upload_mbps.desc(), Worker.id))]
        self.rank = {worker_id: i for i, (worker_id, _) in enumerate(self.peers)}
        self.fanout, self.origin = settings.relay_fanout, settings.public_url

    def parents(self, worker_id: str) -> list[str]:
        i = self.rank.get(worker_id)
        if i is not None:
            parents = [self.peers[(i - 1) // self.fanout][1]] if i > 0 else []
        elif self.peers:
            parents = [self.peers[_stable_slot(worker_id, len(self.peers))][1]]
        else:
            parents = []
        return parents + [self.origin]


def _stable_slot(worker_id: str, n: int) -> int:
    return int(worker_id.rsplit("_", 1)[-1], 16) % n
