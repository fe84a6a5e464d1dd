"""Weight retention: a version's chunks are deleted once nothing can need them.

Kept: the newest version and every version a rollout may still be admitted with (x >= t - S) while
the job runs; the final checkpoint (or, for a job that ended without one, the newest version)
forever; and every n-th version when ECHO2_KEEP_VERSIONS_EVERY = n > 0, for users who want
intermediate checkpoints. The row of a collected version stays (timeline, timings) with
`collected_at` set; its manifest, chunks and checkpoint download answer 410.
"""

from __future__ import annotations

from collections.abc import Iterable

from echo2.protocol import JobStatus
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from ..models import Job, WeightVersion, utcnow
from ..storage import BlobStore
from .jobs import spec_of


def kept(job: Job, versions: Iterable[int], every: int) -> set[int]:
    final = job.final_version if job.final_version is not None else job.version
    keep = {v for v in versions if v == final or (every and v % every == 0)}
    if not JobStatus(job.status).is_terminal():
        oldest_admissible = job.step - spec_of(job).staleness
        keep |= {v for v in versions if v == job.version or v >= oldest_admissible}
    return keep


def commit_and_collect(db: Session, blobs: BlobStore, job: Job, every: int) -> None:
    """Commit the caller's transaction with the versions that may go marked collected, then delete
    their files: a failed transaction never leaves a row pointing at deleted files."""
    dropped = _mark_collected(db, job, every)
    db.commit()
    blobs.drop(job.id, dropped)


def _mark_collected(db: Session, job: Job, every: int) -> list[int]:
    stored = set(db.scalars(select(WeightVersion.version).where(WeightVersion.job_id == job.id,
                                                                WeightVersion.collected_at.is_(None))))
    drop = sorted(stored - kept(job, stored, every))
    if drop:
        db.execute(update(WeightVersion).where(WeightVersion.job_id == job.id, WeightVersion.version.in_(drop))
                   .values(collected_at=utcnow()))
    return drop
