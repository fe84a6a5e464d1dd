"""Weight versions at the origin: chunk upload + manifest publish (learner), manifest and chunk
download with Range and sha256 headers (workers, relays), checkpoint download (owner)."""

from __future__ import annotations

import time
from typing import Annotated, Any

import anyio
from echo2.protocol import Form, Manifest, VersionNotice, VersionPublish, VersionRead
from fastapi import Body, Header, Path, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import select

from ..db import Database
from ..deps import (
    AnyPrincipal,
    BlobsDep,
    LearnerJobId,
    Principal,
    SessionDep,
    SettingsDep,
    Token,
    learner_job,
    principal_of,
)
from ..errors import ApiError
from ..files import RangedFileResponse, ReleasingStream
from ..models import Job, WeightVersion
from ..routing import make_router
from ..services import dissemination, modelinfo, notices, rebuild, retention, versions
from ..storage import ChunkError

router = make_router(prefix="/v1/jobs/{job_id}", tags=["weights"])
SHA_HEADER = "X-Echo2-Sha256"
VersionPath = Annotated[int, Path(ge=0, le=10_000_000)]
IndexPath = Annotated[int, Path(ge=0, le=1_000_000)]


@router.put("/versions/{version}/chunks/{index}", status_code=204, operation_id="upload_chunk",
            summary="Upload one chunk of an unpublished version's full form (learner); the body's sha256 must match")
def upload_chunk(job_id: str, version: VersionPath, index: IndexPath, token_job: LearnerJobId,
                 db: SessionDep, blobs: BlobsDep,
                 body: Annotated[bytes, Body(media_type="application/octet-stream")],
                 sha256: Annotated[str, Header(alias=SHA_HEADER, pattern=r"^[0-9a-f]{64}$")]) -> None:
    _upload(db, blobs, token_job, job_id, version, index, body, sha256, Form.full)


@router.put("/versions/{version}/delta/chunks/{index}", status_code=204, operation_id="upload_delta_chunk",
            summary="Upload one chunk of an unpublished version's delta (learner); the body's sha256 must match")
def upload_delta_chunk(job_id: str, version: VersionPath, index: IndexPath, token_job: LearnerJobId,
                       db: SessionDep, blobs: BlobsDep,
                       body: Annotated[bytes, Body(media_type="application/octet-stream")],
                       sha256: Annotated[str, Header(alias=SHA_HEADER, pattern=r"^[0-9a-f]{64}$")]) -> None:
    _upload(db, blobs, token_job, job_id, version, index, body, sha256, Form.delta)


def _upload(db: SessionDep, blobs: BlobsDep, token_job: str, job_id: str, version: int, index: int, body: bytes,
            sha256: str, form: Form) -> None:
    job = learner_job(db, token_job, job_id)
    _check_new_version(job, version)
    if not body:
        raise ApiError(422, "empty chunk", field="body")
    try:
        blobs.put_chunk(job_id, version, index, body, sha256, form)
    except ChunkError as exc:
        raise ApiError(422, str(exc), field=SHA_HEADER) from None


@router.post("/versions", status_code=201, operation_id="publish_version",
             summary="Publish a version, in full, as a delta, or both: every chunk must be uploaded and match; "
                     "then it is announced",
             description="A delta applies to the version published just before it and names that version's files "
                         "by digest; the first version, and a LoRA job's base, must be published in full.")
def publish_version(job_id: str, body: VersionPublish, token_job: LearnerJobId, db: SessionDep,
                    blobs: BlobsDep, settings: SettingsDep, request: Request) -> VersionRead:
    job = learner_job(db, token_job, job_id, for_update=True)
    _check_new_version(job, body.version)
    versions.check_forms(db, job, body)
    try:
        seconds = max(blobs.publish(job_id, m) for m in (body.full, body.delta) if m is not None)
    except ChunkError as exc:
        raise ApiError(422, f"version {body.version} not published: {exc}", field="chunks") from None
    row = versions.row(job, body, seconds, dissemination.targets(db, job_id))
    db.add(row)
    job.version = body.version
    if body.full is not None:
        modelinfo.record(blobs, job, body.full)
    retention.commit_and_collect(db, blobs, job, settings.keep_versions_every)
    request.app.state.announcer.announce(notices.versions(job_id))  # after the commit: whoever wakes sees it
    return dissemination.version_reads(db, [row])[0]


@router.get("/versions", operation_id="list_versions",
            summary="Published versions of a job, with how fast each reached the workers")
def list_versions(job_id: str, p: AnyPrincipal, db: SessionDep) -> list[VersionRead]:
    _readable_job(db, p, job_id)
    rows = db.scalars(select(WeightVersion).where(WeightVersion.job_id == job_id).order_by(WeightVersion.version))
    return dissemination.version_reads(db, list(rows))


@router.get("/versions/next", operation_id="wait_for_version",
            summary="Long-poll: answers as soon as a version newer than `after` is published (or the job ends)",
            description="Workers keep one of these open to hear of a new version at once instead of at their "
                        "next heartbeat; on `changed: false` (the wait timed out) they poll again.")
async def wait_for_version(job_id: str, token: Token, request: Request,
                           after: Annotated[int, Query(ge=-1, le=10_000_000, description="The version you have.")],
                           timeout_s: Annotated[float, Query(ge=0, le=60)] = 25.0) -> VersionNotice:
    db = request.app.state.db  # a session per check: a waiting worker holds no database connection
    await anyio.to_thread.run_sync(_readable_in_session, db, token, job_id)
    deadline = time.monotonic() + timeout_s
    while True:
        notice = await anyio.to_thread.run_sync(_notice, db, job_id, after)
        left = deadline - time.monotonic()
        if notice.changed or left <= 0:
            return notice
        await request.app.state.announcer.wait(notices.versions(job_id), min(left, notices.RECHECK_S))


def _readable_in_session(db: Database, token: str, job_id: str) -> None:
    with db.session() as session:
        _readable_job(session, principal_of(session, token), job_id)


def _notice(db: Database, job_id: str, after: int) -> VersionNotice:
    with db.session() as session:
        job = session.get_one(Job, job_id)
        changed = (job.version is not None and job.version > after) or job.status.is_terminal()
        return VersionNotice(job_id=job_id, version=job.version, job_status=job.status, changed=changed)


@router.get("/versions/{version}/manifest", operation_id="get_manifest",
            summary="A published version's manifest (its full form)",
            responses={404: {"description": "Not published, or published only as a delta."},
                       410: {"description": "Its weights were deleted."}})
def get_manifest(job_id: str, version: VersionPath, p: AnyPrincipal, db: SessionDep) -> Manifest:
    _readable_job(db, p, job_id)
    return Manifest.model_validate(_form(_version(db, job_id, version), Form.full))


@router.get("/versions/{version}/delta/manifest", operation_id="get_delta_manifest",
            summary="A published version's delta manifest: the payload that rebuilds it from the version before",
            responses={404: {"description": "Not published, or published without a delta."},
                       410: {"description": "Its weights were deleted."}})
def get_delta_manifest(job_id: str, version: VersionPath, p: AnyPrincipal, db: SessionDep) -> Manifest:
    _readable_job(db, p, job_id)
    return Manifest.model_validate(_form(_version(db, job_id, version), Form.delta))


CHUNK_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {}}}, 206: {"description": "Partial content"},
    410: {"description": "Its weights were deleted."},
    416: {"description": "The Range starts past the end of the chunk."}}


@router.get("/versions/{version}/chunks/{index}", operation_id="get_chunk",
            summary="Download one chunk of the full form (HTTP Range supported); its sha256 is in X-Echo2-Sha256",
            response_class=RangedFileResponse, responses=CHUNK_RESPONSES)
def get_chunk(job_id: str, version: VersionPath, index: IndexPath, p: AnyPrincipal, db: SessionDep,
              blobs: BlobsDep) -> RangedFileResponse:
    return _chunk(db, blobs, p, job_id, version, index, Form.full)


@router.get("/versions/{version}/delta/chunks/{index}", operation_id="get_delta_chunk",
            summary="Download one chunk of the delta (HTTP Range supported); its sha256 is in X-Echo2-Sha256",
            response_class=RangedFileResponse, responses=CHUNK_RESPONSES)
def get_delta_chunk(job_id: str, version: VersionPath, index: IndexPath, p: AnyPrincipal, db: SessionDep,
                    blobs: BlobsDep) -> RangedFileResponse:
    return _chunk(db, blobs, p, job_id, version, index, Form.delta)


def _chunk(db: SessionDep, blobs: BlobsDep, p: Principal, job_id: str, version: int, index: int,
           form: Form) -> RangedFileResponse:
    _readable_job(db, p, job_id)
    chunks = _form(_version(db, job_id, version), form)["chunks"]
    if index >= len(chunks):
        raise ApiError(404, f"the {form.value} form of version {version} has {len(chunks)} chunks; no chunk {index}")
    db.close()  # the file is sent after this returns: do not hold a database connection meanwhile
    return RangedFileResponse(blobs.chunk_path(job_id, version, index, form), media_type="application/octet-stream",
                              headers={SHA_HEADER: chunks[index]["sha256"]})


@router.get("/checkpoint", operation_id="download_checkpoint",
            summary="Download a version (default: the final one, else the newest published) as a tar of the HF "
                    "model folder",
            response_class=StreamingResponse,
            responses={200: {"content": {"application/x-tar": {}}}, 410: {"description": "Its weights were deleted."},
                       409: {"description": "That version was published only as a delta, and the versions it is "
                                            "built from are deleted."}})
def download_checkpoint(job_id: str, p: AnyPrincipal, db: SessionDep, blobs: BlobsDep,
                        version: Annotated[int | None, Query(ge=0, le=10_000_000)] = None) -> StreamingResponse:
    job = _readable_job(db, p, job_id, owner_only=True)
    chosen = version if version is not None else versions.final_of(job)
    if chosen is None:
        raise ApiError(404, f"job {job_id} has no published version yet")
    manifest = rebuild.full_manifest(db, blobs, _version(db, job_id, chosen))  # a delta is rebuilt in full
    db.close()  # the tar streams after this returns: do not hold a database connection meanwhile
    store, release = versions.pinned(blobs, job_id, manifest)
    filename = f"{job_id}-v{chosen}.tar"
    return ReleasingStream(release, store.iter_tar(job_id, manifest), media_type="application/x-tar",
                             headers={"Content-Disposition": f'attachment; filename="{filename}"',
                                      "X-Echo2-Version": str(chosen)})


def _check_new_version(job: Job, version: int) -> None:
    if job.version is not None and version <= job.version:
        raise ApiError(409, f"version {version} is not newer than the published {job.version}", field="version")


def _form(row: WeightVersion, form: Form) -> dict[str, Any]:
    manifest = row.manifest if form is Form.full else row.delta_manifest
    if manifest is None:
        why = {Form.full: "it was published only as a delta (see its delta/manifest)",
               Form.delta: "it was published only in full (a job's first version, or a base)"}[form]
        raise ApiError(404, f"version {row.version} has no {form.value} form: {why}")
    return manifest


def _version(db: SessionDep, job_id: str, version: int) -> WeightVersion:
    row = db.get(WeightVersion, (job_id, version))
    if row is None:
        raise ApiError(404, f"version {version} of job {job_id} is not published")
    if row.collected_at is not None:
        raise ApiError(410, f"the weights of version {version} of job {job_id} were deleted: no rollout can use "
                            "them any more and they are not a kept checkpoint (see ECHO2_KEEP_VERSIONS_EVERY)")
    return row


def _readable_job(db: SessionDep, p: Principal, job_id: str, owner_only: bool = False) -> Job:
    job = db.get(Job, job_id)
    allowed = job is not None and (
        p.is_admin
        or (p.kind == "user" and job.owner_id == p.id)
        or (not owner_only and p.kind == "learner" and p.id == job_id)
        or (not owner_only and p.kind == "worker" and p.worker is not None and p.worker.job_id == job_id)
    )
    if not allowed:
        raise ApiError(404, f"job {job_id} not found")
    assert job is not None
    return job
