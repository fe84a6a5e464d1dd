"""Weight versions: fixed-size chunks of a model folder plus a manifest naming each chunk's sha256.

A version travels in one or two forms: `full` (the model folder itself) and `delta` (what changed since
the version published before it, echo2.deltas). Every version after a job's first has a delta; every
keyframe (the first, every JobSpec.weights.keyframe_every-th and the final one) also a full form. A
LoRA job's versions after the first carry only the adapter (`Manifest.adapter`): its first version is
the base model they apply to.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
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


class Form(StrEnum):
    full = "full"
    delta = "delta"


class FileRef(Model):
    """A file by its path and content: what a delta rebuilds, or what it must be applied to."""

    path: RelPath
    size: int = Field(ge=0, le=2**42)
    sha256: Sha256


class DeltaInfo(Model):
    base_version: Version = Field(description="The version this delta applies to (the one published before it).")
    base_digest: Sha256 = Field(description="echo2.deltas.files_digest of the base's files: a worker checks that "
                                "the folder it holds is that base before applying.")
    target: list[FileRef] = Field(min_length=1, max_length=4096, description="The files the delta rebuilds, "
                                  "each checked against its sha256 before it is used.")


class AdapterInfo(Model):
    base_version: Version = Field(description="The version holding the base model (a LoRA job's first).")
    base_digest: Sha256 = Field(description="echo2.deltas.files_digest of the base model's files: workers keep "
                                "one copy per digest, across jobs.")


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
    delta: DeltaInfo | None = Field(None, description="Set on a delta: the files are its payload, not a model.")
    adapter: AdapterInfo | None = Field(None, description="Set on a LoRA adapter version.")
    created_at: datetime

    @property
    def form(self) -> Form:
        return Form.delta if self.delta is not None else Form.full

    def target_files(self) -> list[FileRef]:
        """The model files this version stands for: its own, or those its delta rebuilds."""
        if self.delta is not None:
            return list(self.delta.target)
        return [FileRef(path=f.path, size=f.size, sha256=f.sha256) for f in self.files]

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.delta is not None and self.adapter is not None:
            raise ValueError("a manifest is a delta or an adapter, not both")
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


PROBE_BYTES = 4096  # the longest probe: a range this long of a trained version almost surely changed since the last


class Probe(Model):
    """A range of a version's bytes (its model folder as one stream: Manifest.target_files() in order) and the
    sha256 of those bytes: a secret of the control plane, which challenges workers with the range."""

    offset: int = Field(ge=0, le=2**42)
    length: int = Field(ge=1, le=PROBE_BYTES)
    sha256: Sha256


class VersionPublish(Model):
    """A version's forms, published together (announced once both are stored)."""

    full: Manifest | None = Field(None, description="The whole model folder (a keyframe); required for the first "
                                  "version.")
    delta: Manifest | None = Field(None, description="The delta against the version published before it.")
    probes: list[Probe] = Field(default_factory=list, max_length=64, description="Secret ranges of the version's "
                                "model folder (echo2.possession): a worker is leased this version only once it "
                                "hashed one of them from its copy. Never shown back. Without probes a worker "
                                "holds the version when its heartbeat says so.")

    @model_validator(mode="after")
    def _forms(self) -> VersionPublish:
        if self.full is None and self.delta is None:
            raise ValueError("publish a full form, a delta, or both")
        if self.full is not None and self.full.delta is not None:
            raise ValueError("`full` must not be a delta")
        if self.delta is not None and self.delta.delta is None:
            raise ValueError("`delta` must carry delta information")
        if self.full is not None and self.delta is not None and (
                (self.full.version, self.full.step) != (self.delta.version, self.delta.step)):
            raise ValueError("both forms must be of the same version and step")
        return self

    @property
    def version(self) -> int:
        return (self.full or self.delta).version  # type: ignore[union-attr]


class VersionRead(ReadModel):
    job_id: str
    version: int
    step: int
    total_size: int | None = Field(description="Bytes of the full form; null when the version was published only "
                                   "as a delta.")
    num_chunks: int | None = None
    manifest_sha256: str | None = None
    delta_size: int | None = Field(None, description="Bytes of the delta against `delta_base`, when published.")
    delta_base: int | None = None
    adapter: bool = Field(False, description="A LoRA adapter version: its bytes are the adapter's only.")
    publish_seconds: float | None = Field(None, description="Time from the first chunk upload to announcement.")
    available: bool = Field(True, description="Whether the weights are still stored. A version no admissible "
                            "rollout can use any more is deleted unless it is the final (or newest) one or kept by "
                            "the server's ECHO2_KEEP_VERSIONS_EVERY; its row and timings stay.")
    workers_targeted: int = Field(0, description="Workers active on the job when the version was announced.")
    workers_holding: int = Field(0, description="Workers that hold this version: proved it, for a version "
                                 "published with probes; reported it, for one without.")
    dissemination_s: float | None = Field(
        None, description="Seconds from announcement until every targeted worker held it (workers_holding), as "
        "seen in the heartbeats each worker sends right after its download. Targeted workers that left the job, "
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
