"""Held-out evaluation: the learner reads a job's held-out prompts and reports each version's accuracy on
them; the job's owner reads the curve (services/evals.py)."""

from __future__ import annotations

from echo2.protocol import EvalPrompt, EvalRead, EvalReport

from ..deps import CurrentUser, LearnerJobId, SessionDep, learner_job, owned_job
from ..routing import make_router
from ..services import evals

router = make_router(prefix="/v1/jobs/{job_id}", tags=["evaluation"])


@router.get("/learner/eval-prompts", operation_id="learner_eval_prompts",
            summary="The job's held-out prompts with their references (learner only: never leased, never trained)")
def eval_prompts(job_id: str, token_job: LearnerJobId, db: SessionDep) -> list[EvalPrompt]:
    learner_job(db, token_job, job_id)
    return evals.prompts(db, job_id)


@router.post("/learner/evals", operation_id="learner_report_eval",
             summary="Report a version's held-out accuracy (a repeated report of a step replaces it)")
def report_eval(job_id: str, body: EvalReport, token_job: LearnerJobId, db: SessionDep) -> EvalRead:
    job = learner_job(db, token_job, job_id)
    read = evals.record(db, job, body)
    db.commit()
    return read


@router.get("/evals", operation_id="list_job_evals", summary="Held-out accuracy by step: the job's eval curve")
def list_evals(job_id: str, user: CurrentUser, db: SessionDep) -> list[EvalRead]:
    owned_job(db, user, job_id)
    return evals.reads(db, job_id)
