"""A job's cost estimated before it is submitted."""

from __future__ import annotations

from echo2.protocol import JobEstimate, JobSpec

from ..deps import CurrentUser, SessionDep, SettingsDep
from ..routing import make_router
from ..services import jobs, memory
from ..services.estimate import estimate

router = make_router(prefix="/v1", tags=["jobs"])


@router.post("/jobs:estimate", operation_id="estimate_job", summary="Estimate a job's cost before submitting it",
             description="The body of POST /v1/jobs, refused the same way (422 naming the field); nothing is "
                         "created. Learner time comes from earlier jobs like it, workers from the set the capacity "
                         "rule would activate now; `assumptions` says what the figures assume; `learner_memory` what "
                         "each learner GPU must hold (a job no registered learner host can hold is refused, 422, "
                         "with the numbers and what to change).")
def estimate_job(spec: JobSpec, user: CurrentUser, db: SessionDep, settings: SettingsDep) -> JobEstimate:
    jobs.training_items(db, user, spec)
    jobs.check_terms(user, spec, settings)
    jobs.check_references(spec, settings)
    memory.check(db, spec, settings)
    return estimate(db, spec, settings)
