"""Export a job's model as a plain Hugging Face folder (api/services/export.py), streamed as a tar."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query
from fastapi.responses import StreamingResponse

from ..deps import BlobsDep, CurrentUser, SessionDep, owned_job
from ..errors import ApiError
from ..files import ReleasingStream
from ..models import WeightVersion
from ..routing import make_router
from ..services import export, rebuild, versions
from ..services.jobs import spec_of

router = make_router(prefix="/v1/jobs/{job_id}", tags=["weights"])


@router.get("/export", operation_id="export_model",
            summary="The job's model as a plain Hugging Face folder (a tar): safetensors, config, tokenizer and "
                    "generation config, as transformers and vLLM load one; a LoRA job merged, or its adapter alone",
            response_class=StreamingResponse,
            responses={200: {"content": {"application/x-tar": {}}},
                       409: {"description": "That version cannot be exported so (a LoRA job's adapter version "
                                            "merged, a base without adapter, a version published only as a delta)."},
                       410: {"description": "Its weights were deleted."}})
def export_model(job_id: str, user: CurrentUser, db: SessionDep, blobs: BlobsDep,
                 version: Annotated[int | None, Query(ge=0, le=10_000_000, description="Default: the final version, "
                                                      "else the latest published.")] = None,
                 adapter: Annotated[bool, Query(description="A LoRA job's adapter alone (adapter_config.json + "
                                                "adapter_model.safetensors, naming the job's base model) instead "
                                                "of the merged model.")] = False) -> StreamingResponse:
    job = owned_job(db, user, job_id)
    chosen = version if version is not None else versions.final_of(job)
    if chosen is None:
        raise ApiError(404, f"job {job_id} has no published version yet")
    row = db.get(WeightVersion, (job_id, chosen))
    if row is None:
        raise ApiError(404, f"version {chosen} of job {job_id} is not published", field="version")
    if row.collected_at is not None:
        raise ApiError(410, f"the weights of version {chosen} of job {job_id} were deleted (only the final version "
                       "and those rollouts may still use are kept; see ECHO2_KEEP_VERSIONS_EVERY)", field="version")
    manifest = rebuild.full_manifest(db, blobs, row)  # a version published only as a delta is rebuilt in full
    db.close()  # the tar streams after this returns: do not hold a database connection meanwhile
    store, release = versions.pinned(blobs, job_id, manifest)
    try:
        entries = export.plan(store, job, spec_of(job), manifest, adapter)
    except BaseException:
        release()
        raise
    kind = "adapter" if adapter else "model"
    return ReleasingStream(release, export.iter_tar(store, job_id, manifest, entries), media_type="application/x-tar",
                             headers={"Content-Disposition": f'attachment; filename="{job_id}-v{chosen}-{kind}.tar"',
                                      "X-Echo2-Version": str(chosen)})
