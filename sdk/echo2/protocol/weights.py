"""Weight versions: fixed-size chunks of a model folder plus a manifest naming each chunk's sha256."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints, model_validator

from .common import JobStatus, Model, NoNul, ReadModel, Sha256, Step, Version


def _relative(path: str) -> str:
    # A manifest path is joined onto a folder by workers and the checkpoint tar: never let it escape.
    if path.startswith("/") or ".." in path.split("/") or "" in path.split("/"):
        raise ValueError("must be a relative path without '..' or empty segments")
    return path


RelPath = Annotated[
    str, StringConstraints(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.\-/]+$"), AfterValidator(_relative)
]


class ChunkInfo(Model):
    index: int = Field(ge=0, le=1_000_000)
    size: int = Field(ge=1, le=256 * 2**20)
    sha256: Sha256


class FileInfo(Model):
    """A file of the model folder; the folder is the concatenation of files in manifest order."""

    path: RelPath
    size: int = Field(ge=0, le=2**42)
    sha256: Sha256
    offset: int = Field(ge=0, le=2**42, description="Byte offset of the file in the chunked stream.")


class Manifest(Model):
    version: Version
    step: Step
    chunk_size: int = Field(ge=4096, le=256 * 2**20)
    total_size: int = Field(ge=1, le=2**42)
    files: list[FileInfo] = Field(min_length=1, max_length=4096)
    chunks: list[ChunkInfo] = Field(min_length=1, max_length=1_000_000)
    tensor_index: dict[Annotated[str, StringConstraints(max_length=512), NoNul], RelPath] = Field(
        default_factory=dict, max_length=200_000, description="Tensor name -> file holding it."
    )
    created_at: datetime

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if [c.index for c in self.chunks] != list(range(len(self.chunks))):
            raise ValueError("chunks must be numbered 0..n-1 in order")
        if sum(c.size for c in self.chunks) != self.total_size:
            raise ValueError("chunk sizes do not add up to total_size")
        if any(c.size != self.chunk_size for c in self.chunks[:-1]):
            raise ValueError("every chunk but the last must be exactly chunk_size bytes")
        end = 0
        for f in self.files:
            if f.offset != end:
                raise ValueError(f"file {f.path} starts at {f.offset}, expected {end}")
            end += f.size
        if end != self.total_size:
            raise ValueError("file sizes do not add up to total_size")
        if len({f.path for f in self.files}) != len(self.files):
            raise ValueError("duplicate file path")
        return self


class VersionRead(ReadModel):
    job_id: str
    version: int
    step: int
    total_size: int
    num_chunks: int
    manifest_sha256: str
    publish_seconds: float | None = Field(None, description="Time from the first chunk upload to announcement.")
    available: bool = Field(True, description="Whether the weights are still stored. A version no admissible "
                            "rollout can use any more is deleted unless it is the final (or newest) one or kept by "
                            "the server's ECHO2_KEEP_VERSIONS_EVERY; its row and timings stay.")
    workers_targeted: int = Field(0, description="Workers active on the job when the version was announced.")
    workers_holding: int = Field(0, description="Workers that have reported holding this version.")
    dissemination_s: float | None = Field(
        None, description="Seconds from announcement until every targeted worker reported holding it, as seen "
        "in the heartbeat each worker sends right after its download. Targeted workers that left the job, "
        "went offline or moved on to a newer version are not waited for. Null while some still fetch, or "
        "when no worker was targeted.")
    created_at: datetime


class VersionNotice(ReadModel):
    """The answer to a long-poll for a job's next version (GET /v1/jobs/{id}/versions/next)."""

    job_id: str
    version: int | None = Field(description="The newest published version.")
    job_status: JobStatus
    changed: bool = Field(description="True when `version` is newer than the one asked about, or the job ended; "
                          "false when the wait timed out (poll again).")
