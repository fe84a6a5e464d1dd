"""States saved with save_state, stored by the control plane as a learner's checkpoints are: any learner host
loads them, not only the one that saved them.

The host that saves a state uploads its file in chunks (each checked against its sha256, staged), then
commits it: the control plane joins the chunks, checks the whole file's sha256 and moves it into place
(completion last), named by that digest under `{data_dir}/tinker-states/`. A host that loads a state
downloads it by digest and checks it again. Several checkpoints may name one file (copy_weights shares it),
so a file is deleted once no checkpoint names it (`collect`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Annotated

from echo2.protocol.tinker import StateUpload
from fastapi import Body, Header, Request
from fastapi import Path as PathParam
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..errors import ApiError
from ..files import RangedFileResponse
from ..routing import make_router
from .deps import HostUser
from .models import TinkerCheckpoint

router = make_router(prefix="/v1/tinker/host/states", tags=["tinker"], include_in_schema=False)
SHA_HEADER = "X-Echo2-Sha256"
Digest = Annotated[str, PathParam(pattern=r"^[0-9a-f]{64}$")]
CHUNK_BYTES = 32 * 2**20  # what a host sends at once (the body limit of /chunks/ routes is larger)
MAX_CHUNKS = 4096


def root(request: Request) -> Path:
    return request.app.state.settings.data_dir / "tinker-states"


def state_file(base: Path, sha256: str) -> Path:
    return base / f"{sha256}.pt"


@router.put("/{sha256}/chunks/{index}", status_code=204)
def upload_chunk(sha256: Digest, index: Annotated[int, PathParam(ge=0, lt=MAX_CHUNKS)], user: HostUser,
                 request: Request, body: Annotated[bytes, Body(media_type="application/octet-stream")],
                 chunk_sha: Annotated[str, Header(alias=SHA_HEADER, pattern=r"^[0-9a-f]{64}$")]) -> None:
    if not body or hashlib.sha256(body).hexdigest() != chunk_sha:
        raise ApiError(422, f"chunk {index}: empty, or its sha256 is not {chunk_sha}", field=SHA_HEADER)
    staging = root(request) / f"{sha256}.staging"
    staging.mkdir(parents=True, exist_ok=True)
    tmp = staging / f"{index}.tmp"
    tmp.write_bytes(body)
    os.replace(tmp, staging / f"{index}.chunk")


@router.post("/{sha256}", status_code=201)
def commit(sha256: Digest, user: HostUser, request: Request,
           chunks: Annotated[int, Body(embed=True, ge=1, le=MAX_CHUNKS)]) -> StateUpload:
    """Join the staged chunks 0..chunks-1; the whole must hash to `sha256`."""
    base = root(request)
    final = state_file(base, sha256)
    if final.exists():
        return StateUpload(path=final.name, size_bytes=final.stat().st_size, sha256=sha256)
    staging = base / f"{sha256}.staging"
    parts = [staging / f"{i}.chunk" for i in range(chunks)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise ApiError(409, f"state {sha256}: chunks not uploaded: {missing[:5]}", field="chunks")
    digest, tmp = hashlib.sha256(), base / f"{sha256}.pt.tmp"
    with tmp.open("wb") as out:
        for part in parts:
            data = part.read_bytes()
            digest.update(data)
            out.write(data)
        out.flush()
        os.fsync(out.fileno())
    if digest.hexdigest() != sha256:
        tmp.unlink()
        raise ApiError(422, f"the joined chunks hash to {digest.hexdigest()}, not {sha256}", field="sha256")
    os.replace(tmp, final)
    shutil.rmtree(staging, ignore_errors=True)
    return StateUpload(path=final.name, size_bytes=final.stat().st_size, sha256=sha256)


@router.get("/{sha256}", response_class=RangedFileResponse)
def download(sha256: Digest, user: HostUser, request: Request) -> RangedFileResponse:
    path = state_file(root(request), sha256)
    if not path.exists():
        raise ApiError(404, f"state {sha256} is not stored (deleted, or expired)")
    return RangedFileResponse(path, media_type="application/octet-stream", headers={SHA_HEADER: sha256})


def collect(db: Session, base: Path, digests: set[str | None]) -> list[str]:
    """Delete the stored files of these digests that no checkpoint names any more; returns those deleted."""
    gone = []
    for sha in sorted(d for d in digests if d):
        if db.scalar(select(TinkerCheckpoint.name).where(TinkerCheckpoint.sha256 == sha).limit(1)) is None:
            state_file(base, sha).unlink(missing_ok=True)
            shutil.rmtree(base / f"{sha}.staging", ignore_errors=True)
            gone.append(sha)
    return gone
