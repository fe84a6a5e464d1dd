"""Leases and rollout submission: the worker's side of the data plane."""

from __future__ import annotations

from datetime import timedelta
from typing import NoReturn

from echo2.protocol import (
    DesiredState,
    EpisodeReplies,
    EpisodeTurns,
    JobStatus,
    LeaseRead,
    LeaseRequest,
    LeaseStatus,
    RolloutStatus,
    RolloutSubmit,
    RolloutSubmitResult,
)
from fastapi import Request

from ..deps import BlobsDep, CurrentWorker, SessionDep, SettingsDep
from ..errors import ApiError
from ..models import Job, Lease, Prompt, Worker, utcnow
from ..routing import make_router
from ..services import admission, episodes, notices, pool, trust
from ..services.jobs import sampling_of, spec_of
from ..settings import Settings
from ..tinker import fleet as tinker_fleet
from ..tinker import service as tinker_service

router = make_router(prefix="/v1", tags=["leases"])


@router.post("/leases", status_code=201, operation_id="create_lease",
             summary="Lease a batch of server-chosen prompts of the job this worker is assigned to",
             responses={403: {"description": "Not assigned to this job, or quarantined or banned."},
                        409: {"description": "Version too stale, or no prompts free (Retry-After); or this worker "
                                             "has held prompts without sending a group for longer than it may "
                                             "(ECHO2_LEASE_IDLE_S)."}})
def create_lease(body: LeaseRequest, worker: CurrentWorker, db: SessionDep, settings: SettingsDep) -> LeaseRead:
    if not worker.trust.can_work():
        raise ApiError(403, f"this worker gets no leases: {trust.notice(worker)}")
    if worker.job_id != body.job_id or worker.desired != DesiredState.active:
        raise ApiError(403, f"this worker is not assigned to job {body.job_id}; follow the heartbeat reply",
                       field="job_id")
    job = db.get(Job, body.job_id)  # no job lock: prompts are claimed row by row (SKIP LOCKED)
    if job is None or job.status != JobStatus.running:
        raise ApiError(409, f"job {body.job_id} is not running", field="job_id")
    idle_s = pool.idle_past_bound(db, worker, utcnow(), body.max_prompts, settings)
    if idle_s is not None:
        _idle(db, worker, idle_s, settings, "no lease")
    lease, prompts = pool.create_lease(db, job, worker, body.max_prompts, body.version, settings.lease_ttl_s)
    read = _read(db, lease, job, prompts)
    db.commit()
    return read


@router.post("/leases/{lease_id}/renew", operation_id="renew_lease", summary="Extend an active lease by its TTL",
             responses={409: {"description": "The lease ended; or its worker has held prompts without sending a "
                                             "group for longer than it may (ECHO2_LEASE_IDLE_S), and it ends now."}})
def renew_lease(lease_id: str, worker: CurrentWorker, db: SessionDep, settings: SettingsDep) -> LeaseRead:
    lease, job = _own(db, worker, lease_id)
    if lease.status != LeaseStatus.active or lease.expires_at < utcnow():
        ended = lease.status if lease.status != LeaseStatus.active else LeaseStatus.expired
        raise ApiError(409, f"lease {lease_id} is {ended}")
    idle_s = pool.idle_past_bound(db, worker, lease.created_at, 0, settings)
    if idle_s is not None:
        pool.end_lease(db, lease, LeaseStatus.expired)
        _idle(db, worker, idle_s, settings, f"lease {lease_id} ended")
    lease.expires_at = utcnow() + timedelta(seconds=settings.lease_ttl_s)
    read = _read(db, lease, job)
    db.commit()
    return read


@router.post("/leases/{lease_id}/complete", operation_id="complete_lease",
             summary="Close a lease; prompts without a rollout go back to the pool")
def complete_lease(lease_id: str, worker: CurrentWorker, db: SessionDep) -> LeaseRead:
    return _close(db, worker, lease_id, LeaseStatus.completed)


@router.post("/leases/{lease_id}/release", operation_id="release_lease",
             summary="Give a lease back unfinished (e.g. on drain or a weight swap); its prompts return")
def release_lease(lease_id: str, worker: CurrentWorker, db: SessionDep) -> LeaseRead:
    return _close(db, worker, lease_id, LeaseStatus.released)


@router.post("/leases/{lease_id}/rollouts", operation_id="submit_rollouts",
             summary="Submit version-tagged groups for prompts of this lease (idempotent per prompt)")
def submit_rollouts(lease_id: str, body: RolloutSubmit, worker: CurrentWorker, db: SessionDep,
                    settings: SettingsDep, request: Request) -> RolloutSubmitResult:
    # One worker's submissions take turns, its row read afresh: a burst of forged groups sent at once is one
    # strike each, not one in all (each request read strikes = 0 with the token), and rows are locked in one
    # order, worker then lease (a quarantine ends the worker's other leases: the reverse order deadlocked).
    db.refresh(worker, with_for_update=True)
    lease, job = _own(db, worker, lease_id)  # no job lock: the claim re-checks staleness
    if job.status.is_terminal():
        raise ApiError(409, f"job {job.id} is {job.status}; rollouts are no longer accepted")
    if lease.status == LeaseStatus.active and lease.expires_at < utcnow():
        pool.end_lease(db, lease, LeaseStatus.expired)
    results = admission.submit_groups(db, job, lease, worker, body.groups, settings)
    answered, audits = tinker_fleet.after_submit(db, job, lease, worker, settings)
    db.commit()
    announcer = request.app.state.announcer
    if any(r.status is RolloutStatus.accepted for r in results):  # a learner waiting to claim hears at once
        announcer.announce(notices.rollouts(job.id))
    for request_id in answered:  # a Tinker client waiting on its future hears at once
        announcer.announce(tinker_service.request_key(request_id))
    if audits:
        announcer.announce(tinker_service.HOSTS_KEY)
    return RolloutSubmitResult(results=results)


@router.post("/leases/{lease_id}/episodes", operation_id="play_episode_turns",
             summary="Multi-turn tasks: play model turns of the lease's episodes; the answers are the environment's",
             description="Each step is the model's tokens for one turn of sample `sample` of a leased prompt; the "
                         "control plane decodes them, runs the task's environment (its secrets and the reward stay "
                         "here) and answers, per step, with the tokens to append before that episode's next turn, "
                         "or `done`. A retried turn gets the same answer; a bad step refuses the whole request. "
                         "Submit a group once its episodes are done, each sample's tokens being all its turns in "
                         "order with `turns` giving their lengths.",
             responses={409: {"description": "Single-turn job, lease over, episode over, or turns out of order."},
                        422: {"description": "Too many tokens, or tokens outside the vocabulary."},
                        429: {"description": f"This worker has {episodes.PER_WORKER} requests playing already, "
                                           f"or this API process {episodes.IN_FLIGHT} (slow environments never "
                                           "take every request thread): retry after Retry-After seconds."}})
def play_episode_turns(lease_id: str, body: EpisodeTurns, worker: CurrentWorker, db: SessionDep,
                       blobs: BlobsDep) -> EpisodeReplies:
    # The lease row is not locked: its environments may take a while, and renewals must not wait on
    # them. Each episode's row is (api/services/episodes.py).
    lease, job = _own(db, worker, lease_id, lock=False)
    if job.status != JobStatus.running:
        raise ApiError(409, f"job {job.id} is {job.status}; its episodes are over")
    with episodes.playing_slot(worker.id):
        replies = episodes.play(db, blobs, lease, job, body.steps)
    db.commit()
    return EpisodeReplies(replies=replies)


def _close(db: SessionDep, worker: Worker, lease_id: str, status: LeaseStatus) -> LeaseRead:
    lease, job = _own(db, worker, lease_id)
    if lease.status == LeaseStatus.active:
        pool.end_lease(db, lease, status)
    read = _read(db, lease, job)
    db.commit()
    return read


def _idle(db: SessionDep, worker: Worker, idle_s: float, settings: Settings, what: str) -> NoReturn:
    """A worker that held prompts without generating them is measured at zero, as a trial that delivered nothing
    is (the scheduler deactivates it for a while)."""
    worker.trial_failed_at = utcnow()
    db.commit()
    raise ApiError(409, f"{what}: this worker has held prompts for {idle_s:.0f} s without sending a group (more than "
                        f"{settings.lease_idle_s:g} s, and than {pool.IDLE_PATIENCE:g} times what its own groups "
                        "took); prompts held and not generated keep every other worker from them")


def _own(db: SessionDep, worker: Worker, lease_id: str, lock: bool = True) -> tuple[Lease, Job]:
    lease = db.get(Lease, lease_id, with_for_update=lock)
    if lease is None or lease.worker_id != worker.id:  # another's answers as an unknown one: ids leak nothing
        raise ApiError(404, f"lease {lease_id} not found")
    job = db.get(Job, lease.job_id)
    assert job is not None
    return lease, job


def _read(db: SessionDep, lease: Lease, job: Job, prompts: list[Prompt] | None = None) -> LeaseRead:
    return LeaseRead(
        id=lease.id, job_id=lease.job_id, worker_id=lease.worker_id, status=lease.status,
        version=lease.version, prompts=pool.leased_prompts(db, lease, job, prompts),
        sampling=sampling_of(spec_of(job)),
        expires_at=lease.expires_at, created_at=lease.created_at, episode=episodes.limits(job),
    )
