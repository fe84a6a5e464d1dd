"""What a learner needs to resume exactly, on any host: its checkpoints, stored through the control plane
(chunked and hashed like weight versions, never announced to workers), and the steps committed since,
each as it was trained (its groups in order and the rewards the learner computed), to replay."""

from __future__ import annotations

from typing import Annotated

from echo2.protocol import Manifest, ReplayStep
from fastapi import Body, Header, Path
from sqlalchemy import select

from ..deps import CheckpointsDep, LearnerJobId, SessionDep, SettingsDep, learner_job
from ..errors import ApiError
from ..files import RangedFileResponse
from ..models import Rollout, StepMetric
from ..routing import make_router
from ..services import admission
from ..storage import ChunkError
from .weights import SHA_HEADER, IndexPath

router = make_router(prefix="/v1/jobs/{job_id}/learner", tags=["learner"])
StepPath = Annotated[int, Path(ge=0, le=10_000_000)]
KEEP = 2  # checkpoints kept per job: the newest and the one before, in case the newest is being read


@router.put("/checkpoints/{step}/chunks/{index}", status_code=204, operation_id="upload_learner_checkpoint_chunk",
            summary="Upload one chunk of a learner checkpoint (learner); the body's sha256 must match")
def upload_chunk(job_id: str, step: StepPath, index: IndexPath, token_job: LearnerJobId, db: SessionDep,
                 store: CheckpointsDep, body: Annotated[bytes, Body(media_type="application/octet-stream")],
                 sha256: Annotated[str, Header(alias=SHA_HEADER, pattern=r"^[0-9a-f]{64}$")]) -> None:
    learner_job(db, token_job, job_id)
    if not body:
        raise ApiError(422, "empty chunk", field="body")
    try:
        store.put_chunk(job_id, step, index, body, sha256)
    except ChunkError as exc:
        raise ApiError(422, str(exc), field=SHA_HEADER) from None


@router.post("/checkpoints", status_code=201, operation_id="commit_learner_checkpoint",
             summary="Commit a learner checkpoint whose chunks are all uploaded; a relaunched learner resumes "
                     "from the newest")
def commit(job_id: str, manifest: Manifest, token_job: LearnerJobId, db: SessionDep,
           store: CheckpointsDep) -> Manifest:
    job = learner_job(db, token_job, job_id, for_update=True)
    if manifest.step > job.step:
        raise ApiError(409, f"a checkpoint of step {manifest.step} is ahead of the {job.step} steps committed",
                       field="step")
    try:
        store.publish(job_id, manifest)
    except ChunkError as exc:
        raise ApiError(422, f"checkpoint {manifest.step} not stored: {exc}", field="chunks") from None
    previous = job.checkpoint_step
    if previous is None or manifest.step > previous:
        job.checkpoint_step = manifest.step
    db.commit()
    store.drop(job_id, store.finals(job_id)[:-KEEP])
    return manifest


@router.get("/checkpoints/latest", operation_id="get_learner_checkpoint",
            summary="The manifest of the newest learner checkpoint (404 when there is none)")
def latest(job_id: str, token_job: LearnerJobId, db: SessionDep, store: CheckpointsDep) -> Manifest:
    job = learner_job(db, token_job, job_id)
    if job.checkpoint_step is None:
        raise ApiError(404, f"job {job_id} has no learner checkpoint yet")
    path = store.chunk_path(job_id, job.checkpoint_step, 0).with_name("manifest.json")
    return Manifest.model_validate_json(path.read_bytes())


@router.get("/checkpoints/{step}/chunks/{index}", operation_id="get_learner_checkpoint_chunk",
            summary="Download one chunk of a learner checkpoint; its sha256 is in X-Echo2-Sha256",
            response_class=RangedFileResponse,
            responses={200: {"content": {"application/octet-stream": {}}}, 206: {"description": "Partial content"},
                       416: {"description": "The Range starts past the end of the chunk."}})
def get_chunk(job_id: str, step: StepPath, index: IndexPath, token_job: LearnerJobId, db: SessionDep,
              store: CheckpointsDep) -> RangedFileResponse:
    learner_job(db, token_job, job_id)
    path = store.chunk_path(job_id, step, index)
    if not path.exists():
        raise ApiError(404, f"checkpoint {step} of job {job_id} has no chunk {index}")
    db.close()
    return RangedFileResponse(path, media_type="application/octet-stream",
                              headers={SHA_HEADER: path.with_suffix(".sha256").read_text()})


@router.get("/steps/{step}", operation_id="get_committed_step",
            summary="A committed step as it was trained: its groups in order and their rewards (for replay)")
def committed_step(job_id: str, step: StepPath, token_job: LearnerJobId, db: SessionDep,
                   settings: SettingsDep) -> ReplayStep:
    learner_job(db, token_job, job_id)
    metric = db.get(StepMetric, (job_id, step))
    if metric is None:
        raise ApiError(404, f"step {step} of job {job_id} is not committed")
    rows = {r.id: r for r in db.scalars(select(Rollout).where(Rollout.id.in_(metric.rollout_ids)))}
    ordered = [rows[i] for i in metric.rollout_ids]
    return ReplayStep(step=step, groups=admission.claimed_groups(db, ordered, lambda _: False, settings.data_dir),
                      rewards={r.id: r.rewards or [] for r in ordered})
