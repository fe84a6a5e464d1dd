"""Jobs: submit, list, inspect, cancel; their prompts, rollouts and metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from echo2.protocol import (
    AuditRead,
    DecisionRead,
    JobKind,
    JobRead,
    JobReport,
    JobSpec,
    JobStatus,
    JobUpdate,
    Page,
    PromptRead,
    PromptState,
    Role,
    RolloutRead,
    RolloutStatus,
    StepMetrics,
    TaskInfo,
)
from fastapi import Header, Query, Response
from sqlalchemy import func, select

from tasks import get_task, list_tasks

from ..deps import BlobsDep, CheckpointsDep, CurrentUser, PassedFilter, SessionDep, SettingsDep, owned_job
from ..models import Audit, Decision, Job, Prompt, Rollout, StepMetric
from ..routing import make_router
from ..services import archive, modelinfo, reports, retention, tenancy, trust
from ..services import jobs as svc
from ..services.ledger import next_offset

router = make_router(prefix="/v1", tags=["jobs"])
Limit = Annotated[int, Query(ge=1, le=200, description="Page size.")]
Offset = Annotated[int, Query(ge=0, le=10_000_000, description="Items to skip.")]
NameFilter = Annotated[str | None, Query(max_length=128, pattern=r"^[^\x00]*$", description="Substring of the name.")]
IdempotencyKey = Annotated[
    str | None,
    Header(max_length=128, pattern=r"^[\x21-\x7e]+$",
           description="Replaying a create with the same key returns the same job (printable ASCII)."),
]


@router.post("/jobs", status_code=201, operation_id="create_job", summary="Submit a GRPO training job",
             responses={200: {"model": JobRead, "description": "A replay of an Idempotency-Key: the job it created."}})
def create_job(spec: JobSpec, user: CurrentUser, db: SessionDep, settings: SettingsDep, response: Response,
               idempotency_key: IdempotencyKey = None) -> JobRead:
    job, created = svc.create_job(db, user, spec, idempotency_key, settings)
    db.commit()
    if not created:
        response.status_code = 200
    return svc.job_read(job)


@router.get("/jobs", operation_id="list_jobs", summary="List your jobs, newest first")
def list_jobs(user: CurrentUser, db: SessionDep, limit: Limit = 20, offset: Offset = 0,
              status: JobStatus | None = None,
              name: NameFilter = None,
              tinker: Annotated[bool | None, Query(description="true: only the fleet jobs of Tinker models (one per "
                                                   "model that saved a sampler); false: leave them out.")] = None,
              ) -> Page[JobRead]:
    query = select(Job)
    if user.role != "admin":
        query = query.where(Job.owner_id == user.id)
    if status is not None:
        query = query.where(Job.status == status)
    if tinker is not None:
        query = query.where((Job.kind == JobKind.tinker_fleet) if tinker else (Job.kind != JobKind.tinker_fleet))
    if name:
        query = query.where(Job.name.contains(name, autoescape=True))
    total = db.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = db.scalars(query.order_by(Job.created_at.desc(), Job.id).limit(limit).offset(offset))
    items = [svc.job_read(j) for j in rows]
    return Page[JobRead](items=items, total=total, next_offset=next_offset(offset, len(items), total))


@router.get("/jobs/{job_id}", operation_id="get_job", summary="Get a job")
def get_job(job_id: str, user: CurrentUser, db: SessionDep) -> JobRead:
    return svc.job_read(owned_job(db, user, job_id))


@router.patch("/jobs/{job_id}", operation_id="update_job", summary="Change a job's budget (resumes one it paused)",
              responses={409: {"description": "The job already finished."}})
def update_job(job_id: str, body: JobUpdate, user: CurrentUser, db: SessionDep) -> JobRead:
    job = owned_job(db, user, job_id, for_update=True)
    svc.update_job(job, body)
    db.commit()
    return svc.job_read(job)


@router.post("/jobs/{job_id}/cancel", operation_id="cancel_job", summary="Cancel a job",
             description="Training stops now. Of its weights the newest version stays downloadable; earlier "
                         "versions are deleted at once (410) unless the server keeps them as checkpoints "
                         "(ECHO2_KEEP_VERSIONS_EVERY).",
             responses={409: {"description": "The job already finished."}})
def cancel_job(job_id: str, user: CurrentUser, db: SessionDep, blobs: BlobsDep, checkpoints: CheckpointsDep,
               settings: SettingsDep) -> JobRead:
    job = owned_job(db, user, job_id, for_update=True)
    svc.finish_job(db, job, JobStatus.cancelled, f"cancelled by {user.name}")
    retention.commit_and_collect(db, blobs, job, settings.keep_versions_every)
    retention.drop_learner_state(checkpoints, job)
    return svc.job_read(job)


@router.post("/jobs/{job_id}/resume", operation_id="resume_job",
             summary="Resume a job its task paused (paused_for `reward`): queued again, its learner resumes from its "
                     "checkpoint",
             responses={409: {"description": "The job is not paused, or paused by its budget or quota (raise the "
                                             "budget; a quota resumes by itself)."}})
def resume_job(job_id: str, user: CurrentUser, db: SessionDep) -> JobRead:
    job = owned_job(db, user, job_id, for_update=True)
    svc.resume_by_owner(job)
    db.commit()
    return svc.job_read(job)


@router.get("/jobs/{job_id}/prompts", operation_id="list_job_prompts", summary="A job's prompts and their state")
def list_prompts(job_id: str, user: CurrentUser, db: SessionDep, limit: Limit = 50, offset: Offset = 0,
                 held_out: Annotated[bool, Query(description="The held-out prompts (state `eval`, never trained "
                                                 "on) instead of the training ones.")] = False) -> Page[PromptRead]:
    owned_job(db, user, job_id)
    split = (Prompt.state == PromptState.eval) if held_out else (Prompt.state != PromptState.eval)
    total = db.scalar(select(func.count()).where(Prompt.job_id == job_id, split)) or 0
    rows = db.scalars(select(Prompt).where(Prompt.job_id == job_id, split).order_by(Prompt.index).limit(limit)
                      .offset(offset))
    items = [PromptRead.model_validate(p) for p in rows]
    return Page[PromptRead](items=items, total=total, next_offset=next_offset(offset, len(items), total))


@router.get("/jobs/{job_id}/rollouts", operation_id="list_job_rollouts", summary="A job's rollouts, newest first",
            responses={410: {"description": "Its tokens were deleted by retention."}})
def list_rollouts(job_id: str, user: CurrentUser, db: SessionDep, blobs: BlobsDep, settings: SettingsDep,
                  limit: Limit = 20, offset: Offset = 0, status: RolloutStatus | None = None) -> Page[RolloutRead]:
    owned_job(db, user, job_id)
    query = select(Rollout, Prompt.text).join(Prompt, Prompt.id == Rollout.prompt_id).where(Rollout.job_id == job_id)
    if status is not None:
        query = query.where(Rollout.status == status)
    total = db.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = db.execute(query.order_by(Rollout.created_at.desc(), Rollout.id).limit(limit).offset(offset)).all()
    decode = modelinfo.decoder(blobs, job_id)
    tokens = archive.payloads(settings.data_dir, [r for r, _ in rows])
    items = [_rollout_read(r, text, tokens[r.id], decode) for r, text in rows]
    return Page[RolloutRead](items=items, total=total, next_offset=next_offset(offset, len(items), total))


@router.get("/jobs/{job_id}/metrics", operation_id="get_job_metrics", summary="Per-step training metrics")
def get_metrics(job_id: str, user: CurrentUser, db: SessionDep,
                since_step: Annotated[int, Query(ge=0, le=10_000_000, description="First step to return.")] = 0,
                limit: Annotated[int, Query(ge=1, le=5000)] = 1000) -> list[StepMetrics]:
    owned_job(db, user, job_id)
    rows = db.scalars(select(StepMetric).where(StepMetric.job_id == job_id, StepMetric.step >= since_step)
                      .order_by(StepMetric.step).limit(limit))
    return [StepMetrics.model_validate(m) for m in rows]


@router.get("/jobs/{job_id}/report", operation_id="get_job_report",
            summary="Learner utilisation and waste: the learner's busy and idle time, every group by its fate")
def get_report(job_id: str, user: CurrentUser, db: SessionDep) -> JobReport:
    return reports.job_report(db, owned_job(db, user, job_id))


@router.get("/jobs/{job_id}/decisions", operation_id="list_job_decisions",
            summary="The scheduler's activation decisions for this job, newest first, each explained in one line "
                    "(a run of the same action for a worker is one line with its count)")
def list_decisions(job_id: str, user: CurrentUser, db: SessionDep, limit: Limit = 50) -> list[DecisionRead]:
    owned_job(db, user, job_id)
    rows = db.scalars(select(Decision).where(Decision.job_id == job_id)
                      .order_by(Decision.decided_at.desc(), Decision.id.desc()).limit(limit))
    reads = [DecisionRead.model_validate(d) for d in rows]
    if user.role is Role.admin:
        return reads
    own = tenancy.own_jobs(db, user.id)  # a line or trigger may name another tenant's job: not to this reader
    return [r.model_copy(update={"line": tenancy.redact(r.line, own), "trigger": tenancy.redact(r.trigger, own)})
            for r in reads]


@router.get("/jobs/{job_id}/audits", operation_id="list_job_audits",
            summary="The learner's audits of this job's rollouts, newest first (failed ones name the worker)")
def list_job_audits(job_id: str, user: CurrentUser, db: SessionDep,
                    passed: PassedFilter = None,
                    limit: Limit = 50) -> list[AuditRead]:
    owned_job(db, user, job_id)
    return trust.audit_reads(db, select(Audit).where(Audit.job_id == job_id), passed, limit)


@router.get("/tasks", operation_id="list_tasks", summary="Registered task adapters and their parameters")
def tasks(_: CurrentUser) -> list[TaskInfo]:
    out = []
    for name in list_tasks():
        adapter = get_task(name)
        out.append(TaskInfo(name=name, description=adapter.description,
                            needs_dataset=adapter.needs_dataset, params_schema=adapter.Params.model_json_schema()))
    return out


def _rollout_read(r: Rollout, prompt_text: str, tokens: archive.Payload,
                  decode: Callable[[list[int]], str]) -> RolloutRead:
    return RolloutRead(
        id=r.id, job_id=r.job_id, prompt_id=r.prompt_id, prompt_text=prompt_text, worker_id=r.worker_id,
        lease_id=r.lease_id, version=r.version, status=r.status, reason=r.reason,
        reject_kind=r.reject_kind, fault=r.reject_kind.fault() if r.reject_kind else None,
        audit=r.audit, trained_step=r.trained_step, completions=[decode(s["token_ids"]) for s in tokens.samples],
        rewards=r.rewards, created_at=r.created_at,
    )
