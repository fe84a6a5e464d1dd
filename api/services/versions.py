"""Published versions and their forms (echo2.protocol.weights): what a publication must satisfy, the row
it becomes, and which artifacts a worker fetches to hold the newest one (services/plans.py)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from echo2.deltas import files_digest
from echo2.protocol import FetchStep, FileRef, Form, Manifest, VersionPublish
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..errors import ApiError
from ..models import Job, WeightVersion
from ..storage import BlobStore
from .plans import Forms, plan


def check_forms(db: Session, job: Job, body: VersionPublish) -> None:
    """A delta applies to the version published just before it, whose files it names by digest; the first
    version and any base are full; an adapter names a base this job published."""
    if job.version is None and body.full is None:
        raise ApiError(422, "a job's first version must be published in full", field="full")
    if body.delta is not None:
        assert body.delta.delta is not None
        base = body.delta.delta.base_version
        if base != job.version:
            raise ApiError(422, f"a delta applies to the version published just before it ({job.version}), "
                           f"not to {base}", field="delta.delta.base_version")
        _check_digest(db, job, base, body.delta.delta.base_digest, "delta.delta.base_digest")
    adapter = (body.full or body.delta).adapter  # type: ignore[union-attr]
    if adapter is not None:
        _check_digest(db, job, adapter.base_version, adapter.base_digest, "adapter.base_digest")
    _check_probes(body)


def _check_probes(body: VersionPublish) -> None:
    """Each probe a range of the version's model folder (echo2.possession), which its files' sizes bound."""
    size = sum(f.size for f in (body.full or body.delta).target_files())  # type: ignore[union-attr]
    for i, probe in enumerate(body.probes):
        if probe.offset + probe.length > size:
            raise ApiError(422, f"bytes {probe.offset}..{probe.offset + probe.length} are outside the version's "
                           f"{size} bytes", field=f"probes[{i}]")


def _check_digest(db: Session, job: Job, version: int, digest: str, field: str) -> None:
    row = db.get(WeightVersion, (job.id, version))
    if row is None:
        raise ApiError(422, f"version {version} of job {job.id} is not published", field=field)
    if files_digest(target_files(row)) != digest:
        raise ApiError(422, f"the files of version {version} do not have this digest", field=field)


def target_files(row: WeightVersion) -> list[FileRef]:
    """The model files a published version stands for, whichever form it was published in."""
    manifest = row.manifest if row.manifest is not None else row.delta_manifest
    assert manifest is not None
    return Manifest.model_validate(manifest).target_files()


def row(job: Job, body: VersionPublish, seconds: float, targets: list[str]) -> WeightVersion:
    full, delta = body.full, body.delta
    any_form = full or delta
    assert any_form is not None
    return WeightVersion(
        job_id=job.id, version=any_form.version, step=any_form.step, publish_seconds=seconds, targets=targets,
        manifest=full.model_dump(mode="json") if full else None,
        manifest_sha256=hashlib.sha256(canonical(full)).hexdigest() if full else None,
        total_size=full.total_size if full else None, num_chunks=len(full.chunks) if full else None,
        delta_manifest=delta.model_dump(mode="json") if delta else None,
        delta_size=delta.total_size if delta else None,
        delta_base=delta.delta.base_version if delta and delta.delta else None,
        adapter_base=full.adapter.base_version if full and full.adapter else None,
        probes=[p.model_dump() for p in body.probes] or None)


def canonical(manifest: Manifest) -> bytes:
    return json.dumps(manifest.model_dump(mode="json"), sort_keys=True).encode()


def final_of(job: Job) -> int | None:
    """The version that stands for the job's result: its final one, else its newest (None before the first)."""
    return job.final_version if job.final_version is not None else job.version


def keyframes(db: Session, job_id: str) -> list[int]:
    """Versions still stored in full, ascending."""
    return list(db.scalars(select(WeightVersion.version).where(
        WeightVersion.job_id == job_id, WeightVersion.manifest.is_not(None), WeightVersion.collected_at.is_(None))
        .order_by(WeightVersion.version)))


def stored_forms(db: Session, job_id: str) -> dict[int, Forms]:
    """The forms of every version whose weights are still stored, for fetch plans."""
    rows = db.execute(select(WeightVersion.version, WeightVersion.total_size, WeightVersion.delta_size,
                             WeightVersion.delta_base, WeightVersion.adapter_base)
                      .where(WeightVersion.job_id == job_id, WeightVersion.collected_at.is_(None)))
    return {r.version: Forms(r.total_size, r.delta_size, r.delta_base, r.adapter_base) for r in rows}


def fetch_steps(forms: dict[int, Forms], target: int, held: set[int], base_url: str) -> list[FetchStep]:
    """What a worker holding `held` downloads to hold `target`, cheapest in bytes (plans.plan)."""
    steps = plan(forms, target, held) or []
    bases = {f.adapter_base for f in forms.values() if f.adapter_base is not None}
    out = []
    for version, form in steps:
        size = forms[version].full_size if form is Form.full else forms[version].delta_size
        suffix = "manifest" if form is Form.full else "delta/manifest"
        out.append(FetchStep(version=version, form=form, size=size or 0, shared=version in bases,
                             manifest_url=f"{base_url}/versions/{version}/{suffix}"))
    return out


def pinned(blobs: BlobStore, job_id: str, manifest: Manifest) -> tuple[BlobStore, Callable[[], None]]:
    """The version's files, kept for the download however long it takes, and what releases them (BlobStore.pin)."""
    try:
        return blobs.pin(job_id, manifest)
    except FileNotFoundError:
        raise ApiError(410, f"the weights of version {manifest.version} of job {job_id} were deleted just now: no "
                            "rollout can use them any more; ask again for the newest version") from None
