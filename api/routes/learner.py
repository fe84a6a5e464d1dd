"""The learner's routes: token issue (admin), start/resume, claim, step reports, heartbeat, finish."""

from __future__ import annotations

import time

import anyio
from echo2.protocol import (
    AuditsRecorded,
    AuditVerdicts,
    FinishOutcome,
    JobRead,
    JobStatus,
    LearnerBatch,
    LearnerClaim,
    LearnerFinish,
    LearnerHeartbeat,
    LearnerStartReply,
    LearnerTokenIssued,
    StepAck,
    StepReport,
)
from fastapi import Request
from sqlalchemy import select

from ..db import Database
from ..deps import (
    AdminUser,
    BlobsDep,
    CheckpointsDep,
    LearnerJobId,
    SessionDep,
    SettingsDep,
    Token,
    learner_job,
    owned_job,
    principal_of,
    require_kind,
)
from ..errors import ApiError
from ..models import Worker
from ..routing import make_router
from ..services import admission, learning, notices, retention, trust
from ..services.jobs import finish_job, job_read
from ..settings import Settings

router = make_router(prefix="/v1/jobs/{job_id}/learner", tags=["learner"])


@router.post("/token", status_code=201, operation_id="issue_learner_token",
             summary="Issue the job's learner token (admin); earlier learner tokens are revoked")
def issue_token(job_id: str, admin: AdminUser, db: SessionDep) -> LearnerTokenIssued:
    job = owned_job(db, admin, job_id)
    plain = learning.issue_learner_token(db, job)
    db.commit()
    return LearnerTokenIssued(job_id=job.id, token=plain)


@router.post("/start", operation_id="learner_start",
             summary="Start or resume: marks the job running and returns the step to resume at")
def start(job_id: str, token_job: LearnerJobId, db: SessionDep) -> LearnerStartReply:
    job = learner_job(db, token_job, job_id, for_update=True)
    released = learning.start(db, job)
    db.commit()
    return LearnerStartReply(job=job_read(job), step=job.step, version=job.version, released=released,
                             checkpoint_step=job.checkpoint_step)


@router.post("/claim", operation_id="learner_claim",
             summary="Claim admissible rollouts (t - x <= S) for step t or t + 1; staler ones are rejected, re-pooled",
             description="Claims for step t + 1 may be made while step t trains (its rollouts must be admissible at "
                         "t + 1). With `wait_s` the answer waits until some rollout can be claimed, or that long.")
async def claim(job_id: str, body: LearnerClaim, token: Token, request: Request) -> LearnerBatch:
    state = request.app.state
    deadline = time.monotonic() + body.wait_s
    while True:
        batch = await anyio.to_thread.run_sync(_claim_once, state.db, state.settings, token, job_id, body)
        left = deadline - time.monotonic()
        if batch.groups or left <= 0:
            return batch
        await state.announcer.wait(notices.rollouts(job_id), min(left, notices.RECHECK_S))


def _claim_once(database: Database, settings: Settings, token: str, job_id: str, body: LearnerClaim) -> LearnerBatch:
    """One claim in its own session: a waiting learner holds no database connection."""
    with database.session() as db:
        job = learner_job(db, require_kind(principal_of(db, token), "learner").id, job_id, for_update=True)
        if job.status == JobStatus.paused:  # nothing to claim; the next ack tells the learner to stop
            return LearnerBatch(step=body.step, groups=[], rejected_stale=0)
        if job.status != JobStatus.running:
            raise ApiError(409, f"job {job_id} is {job.status}")
        if body.step not in (job.step, job.step + 1):
            raise ApiError(409, f"claims are for step {job.step} (steps committed so far) or the next one, not "
                           f"{body.step}", field="step")
        rows, rejected = admission.claim(db, job, body.step, body.max_groups)
        senders = {w.id: w for w in db.scalars(select(Worker).where(Worker.id.in_({r.worker_id for r in rows})))}
        groups = admission.claimed_groups(
            db, rows, lambda r: trust.should_audit(senders.get(r.worker_id), r, settings), settings.data_dir)
        db.commit()
        return LearnerBatch(step=body.step, groups=groups, rejected_stale=rejected)


@router.post("/audits", operation_id="learner_report_audits",
             summary="Audits of claimed groups, as soon as they are made: their senders' trust moves before the "
                     "step commits")
def report_audits(job_id: str, body: AuditVerdicts, token_job: LearnerJobId, db: SessionDep,
                  settings: SettingsDep) -> AuditsRecorded:
    job = learner_job(db, token_job, job_id, for_update=True)
    recorded = learning.record_audits(db, job, body, settings)
    db.commit()
    return AuditsRecorded(recorded=recorded)


@router.post("/steps", operation_id="learner_report_step",
             summary="Commit a trained step: its rollouts become trained, metrics are stored")
def report_step(job_id: str, body: StepReport, token_job: LearnerJobId, db: SessionDep,
                settings: SettingsDep) -> StepAck:
    job = learner_job(db, token_job, job_id, for_update=True)
    ack = learning.commit_step(db, job, body, settings)
    db.commit()
    return ack


@router.post("/heartbeat", operation_id="learner_heartbeat", summary="Learner liveness and utilisation")
def heartbeat(job_id: str, body: LearnerHeartbeat, token_job: LearnerJobId, db: SessionDep) -> StepAck:
    job = learner_job(db, token_job, job_id, for_update=True)
    learning.record_heartbeat(job, body)
    db.commit()
    return learning.ack(job)


@router.post("/finish", operation_id="learner_finish", summary="Finish the job, naming the final checkpoint version")
def finish(job_id: str, body: LearnerFinish, token_job: LearnerJobId, db: SessionDep, blobs: BlobsDep,
           checkpoints: CheckpointsDep, settings: SettingsDep) -> JobRead:
    job = learner_job(db, token_job, job_id, for_update=True)
    if body.final_version is not None and (job.version is None or body.final_version > job.version):
        raise ApiError(422, f"version {body.final_version} was never published", field="final_version")
    if body.outcome is FinishOutcome.succeeded and body.final_version is None:
        raise ApiError(422, "a succeeded job needs final_version (its checkpoint)", field="final_version")
    finish_job(db, job, JobStatus(body.outcome.value), body.reason)
    job.final_version = body.final_version
    retention.commit_and_collect(db, blobs, job, settings.keep_versions_every)
    retention.drop_learner_state(checkpoints, job)
    return job_read(job)
