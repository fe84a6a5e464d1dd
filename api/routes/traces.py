"""Rollout traces: one group token by token, or a step's groups a page at a time (api/services/traces.py)."""

from __future__ import annotations

from typing import Annotated

from echo2.protocol import Page, RolloutTrace
from fastapi import Path, Query
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..deps import BlobsDep, CurrentUser, SessionDep, SettingsDep, owned_job
from ..errors import ApiError
from ..models import Rollout, User
from ..routing import make_router
from ..services import tenancy, traces
from ..services.ledger import next_offset

router = make_router(prefix="/v1/jobs/{job_id}", tags=["jobs"])
RolloutPath = Annotated[str, Path(max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]


@router.get("/rollouts/{rollout_id}", operation_id="get_rollout_trace",
            summary="One rollout group token by token: each token decoded, its version, the worker's behaviour "
                    "logprob beside the learner's, the worker and its trust state, the audit, rewards and cost",
            responses={410: {"description": "Its tokens were deleted by retention."}})
def get_trace(job_id: str, rollout_id: RolloutPath, user: CurrentUser, db: SessionDep,
              blobs: BlobsDep, settings: SettingsDep) -> RolloutTrace:
    owned_job(db, user, job_id)
    row = db.get(Rollout, rollout_id)
    if row is None or row.job_id != job_id:
        raise ApiError(404, f"rollout {rollout_id} of job {job_id} not found")
    return traces.traces(db, blobs, settings.data_dir, job_id, [row], own=_own(db, user))[0]


@router.get("/traces", operation_id="list_step_traces",
            summary="The traces of the groups a step trained on, in the order the learner took them",
            responses={410: {"description": "Its tokens were deleted by retention."}})
def list_traces(job_id: str, user: CurrentUser, db: SessionDep, blobs: BlobsDep, settings: SettingsDep,
                step: Annotated[int, Query(ge=0, le=10_000_000, description="The learner step.")],
                limit: Annotated[int, Query(ge=1, le=64, description="Page size (traces are large).")] = 16,
                offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0) -> Page[RolloutTrace]:
    owned_job(db, user, job_id)
    where = (Rollout.job_id == job_id, Rollout.trained_step == step)
    total = db.scalar(select(func.count()).where(*where)) or 0
    rows = list(db.scalars(select(Rollout).where(*where).order_by(Rollout.created_at, Rollout.id).limit(limit)
                           .offset(offset)))
    items = traces.traces(db, blobs, settings.data_dir, job_id, rows, own=_own(db, user))
    return Page[RolloutTrace](items=items, total=total, next_offset=next_offset(offset, len(items), total))


def _own(db: Session, user: User) -> set[str] | None:
    """The jobs whose ids a trace may show this user in its worker's evidence; None (all) for an admin, as
    GET /v1/workers/{id} shows them."""
    return None if user.role == "admin" else tenancy.own_jobs(db, user.id)
