"""Retention: what the control plane keeps on disk, and for how long (README "Operating" says the same).

- Weights: a version's chunks are deleted once nothing can need them. Kept: the newest version and every
  version a rollout may still be admitted with (x >= t - S) while the job runs, and what a worker needs to
  reach them: the newest keyframe (a version stored in full) at or below the oldest of them and every version
  after it, since each delta applies to the version before it; the final checkpoint (or, for a job that ended
  without one, the newest version) forever, with, while it is stored only as a delta, the versions it is built
  from (the sweep, or its first download, rebuilds it in full: api/services/rebuild.py); and every n-th
  version stored in full when ECHO2_KEEP_VERSIONS_EVERY = n > 0, for users who want intermediate checkpoints;
  and the base model of any kept LoRA adapter version. The row of a collected version stays (timeline,
  timings) with `collected_at` set; its manifests, chunks and checkpoint download answer 410.
- Learner checkpoints (stored for resuming on another host): the newest two while the job runs
  (api/routes/learner_state.py), none once it ended (its final version is the model).
- Rollout tokens (api/services/archive.py): they leave the database for the job's Parquet archive once
  nothing reads them there (a job that ended ECHO2_ARCHIVE_AFTER_H ago; a running job's groups trained
  ECHO2_ARCHIVE_AFTER_STEPS steps ago, outside the fleet comparison's window, or rejected
  ECHO2_ARCHIVE_AFTER_H ago); the archive is kept forever, or deleted ECHO2_ARCHIVE_KEEP_DAYS after the job
  ended (then their rollouts and traces answer 410). Rows, metrics, audits and the ledger are never deleted.
- Multi-turn episodes (api/services/episodes.py): played turn by turn while their lease is active, deleted
  ECHO2_ARCHIVE_AFTER_H after their last turn once the lease ended (a submitted group's turns are its rollout's).
- Tinker futures (api/tinker/service.py): a request's result is kept ECHO2_ARCHIVE_AFTER_H after its session
  ended, then deleted (the row stays for usage and billing; asking for the result answers 410).
- Dataset uploads (api/services/uploads.py): one that received no part for ECHO2_ARCHIVE_AFTER_H is dropped
  with its parts (an interrupted upload resumes until then); a file refused on completion is dropped at once.

Versions are collected where the API changes a job (publish, finish, cancel). `sweep`, run by each API
process at start and then every ECHO2_RETENTION_SWEEP_S (with the archive's sweep and deletion), catches the
rest: jobs the scheduler closed (budget, dead learner after its last step), files left by a crash between
the commit and the delete, and staging uploads of jobs that ended before publishing them.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from echo2.protocol import JobStatus
from sqlalchemy import Select, exists, func, or_, select, update
from sqlalchemy.orm import Session, aliased

from ..db import Database
from ..errors import ApiError
from ..models import Job, WeightVersion, utcnow
from ..settings import Settings
from ..storage import BlobStore
from ..tinker import service as tinker
from . import archive, episodes, rebuild, uploads, versions
from .jobs import spec_of
from .plans import Forms

log = logging.getLogger(__name__)


def kept(job: Job, forms: dict[int, Forms], every: int) -> set[int]:
    """Of the stored versions (and their forms), those to keep (module docstring)."""
    final = versions.final_of(job)
    keep = {v for v, f in forms.items() if v == final or (every and v % every == 0 and f.full_size is not None)}
    keep |= _built_from(forms, final)  # a delta-only final is rebuilt from them when downloaded (rebuild.py)
    if not job.status.is_terminal():
        oldest = spec_of(job).oldest_admissible(job.step)
        needed = {v for v in forms if v == job.version or v >= oldest}
        floor = min(needed, default=oldest)
        keyframe = max((v for v, f in forms.items() if v <= floor and f.full_size is not None), default=floor)
        keep |= needed | {v for v in forms if v >= keyframe}
    return keep | {forms[v].adapter_base for v in keep if forms[v].adapter_base is not None}  # LoRA bases


def _built_from(forms: dict[int, Forms], version: int | None) -> set[int]:
    """The versions a delta-only `version` is rebuilt from: the deltas back to the newest keyframe."""
    chain: set[int] = set()
    while version is not None and version in forms and forms[version].full_size is None:
        version = forms[version].delta_base
        if version is not None:
            chain.add(version)
    return chain


def commit_and_collect(db: Session, blobs: BlobStore, job: Job, every: int) -> list[int]:
    """Commit the caller's transaction with the versions that may go marked collected, then delete
    their files: a failed transaction never leaves a row pointing at deleted files."""
    dropped = _mark_collected(db, job, every)
    db.commit()
    blobs.drop(job.id, dropped)
    return dropped


async def sweep_periodically(database: Database, blobs: BlobStore, checkpoints: BlobStore,
                             settings: Settings) -> None:
    """`sweep` now and every `settings.retention_sweep_s` (0: once), off the event loop."""
    while True:
        try:
            deleted = await asyncio.to_thread(_sweep_once, database, blobs, checkpoints, settings.keep_versions_every)
            if deleted:
                log.info("retention sweep deleted %d version folders", deleted)
            await asyncio.to_thread(_archive_once, database, settings)
        except Exception:  # a database hiccup must not end the loop: the next period retries
            log.exception("retention sweep failed")
        if not settings.retention_sweep_s:
            return
        await asyncio.sleep(settings.retention_sweep_s)


def _sweep_once(database: Database, blobs: BlobStore, checkpoints: BlobStore, every: int) -> int:
    with database.session() as db:
        return sweep(db, blobs, every, checkpoints)


def _archive_once(database: Database, settings: Settings) -> None:
    with database.session() as db:
        archive.sweep(db, settings.data_dir, settings.archive_after_h, settings.archive_after_steps)
        archive.drop_expired(db, settings.data_dir, settings.archive_keep_days)
        before = utcnow() - timedelta(hours=settings.archive_after_h)
        if gone := episodes.drop_ended(db, before):
            log.info("retention sweep deleted %d played episodes of ended leases", gone)
        if gone := tinker.drop_results(db, before):
            log.info("retention sweep deleted the results of %d futures of ended Tinker sessions", gone)
        if gone := uploads.drop_stale(db, settings, before):
            log.info("retention sweep dropped %d dataset uploads that received nothing for %g h", gone,
                     settings.archive_after_h)


def sweep(db: Session, blobs: BlobStore, every: int, checkpoints: BlobStore | None = None) -> int:
    """Collect what the routes did not; returns how many version folders it deleted."""
    deleted = 0
    for job in db.scalars(select(Job).where(Job.id.in_(_ended_with_extra_versions(every)))).all():
        _rebuild_final(db, blobs, job)
        deleted += len(commit_and_collect(db, blobs, job, every))
    if checkpoints is not None:
        _sweep_learner_state(db, checkpoints)
    return deleted + _sweep_disk(db, blobs)


def _rebuild_final(db: Session, blobs: BlobStore, job: Job) -> None:
    """An ended job's newest version, when it is stored only as a delta, rebuilt in full: the versions it is built
    from may then go (kept holds them till then)."""
    final = versions.final_of(job)
    row = db.get(WeightVersion, (job.id, final)) if final is not None else None
    if row is None or row.manifest is not None or row.collected_at is not None:
        return
    try:
        rebuild.full_manifest(db, blobs, row)
    except ApiError as exc:  # its chain is gone already: nothing to rebuild it from
        log.warning("job %s: %s", job.id, exc.detail)


def drop_learner_state(checkpoints: BlobStore, job: Job) -> None:
    """An ended job's learner checkpoints: nothing will resume from them (its final version is the model)."""
    if not job.status.is_terminal():
        return
    for job_id, step, staging in list(checkpoints.stored()):
        if job_id == job.id and staging:
            checkpoints.drop_staging(job_id, step)
        elif job_id == job.id:
            checkpoints.drop(job_id, [step])


def _sweep_learner_state(db: Session, checkpoints: BlobStore) -> None:
    job_ids = {j for j, _, _ in checkpoints.stored()}
    for job in db.scalars(select(Job).where(Job.id.in_(job_ids))) if job_ids else ():
        drop_learner_state(checkpoints, job)


def _ended_with_extra_versions(every: int) -> Select[tuple[str]]:
    final = func.coalesce(Job.final_version, Job.version)
    final_row = aliased(WeightVersion)
    base_of_final = exists().where(final_row.job_id == WeightVersion.job_id, final_row.version == final,
                                   final_row.adapter_base == WeightVersion.version)  # a LoRA job's kept base
    extra = select(WeightVersion.job_id).join(Job, Job.id == WeightVersion.job_id).where(
        Job.status.in_(JobStatus.ended()),
        WeightVersion.collected_at.is_(None), WeightVersion.version != final, ~base_of_final)
    if every:
        extra = extra.where(or_(WeightVersion.version % every != 0, WeightVersion.manifest.is_(None)))
    return extra.distinct()


def _sweep_disk(db: Session, blobs: BlobStore) -> int:
    blobs.drop_stale_pins()
    on_disk = list(blobs.stored())
    if not on_disk:
        return 0
    jobs = {job.id: job for job in db.scalars(select(Job).where(Job.id.in_({j for j, _, _ in on_disk})))}
    collected = set(db.execute(select(WeightVersion.job_id, WeightVersion.version).where(
        WeightVersion.job_id.in_(jobs), WeightVersion.collected_at.is_not(None))).all())
    deleted = 0
    for job_id, version, staging in on_disk:
        job = jobs.get(job_id)
        if staging and job is not None and job.status.is_terminal():
            blobs.drop_staging(job_id, version)
        elif not staging and (job_id, version) in collected:
            blobs.drop(job_id, [version])
            deleted += 1
    return deleted


def _mark_collected(db: Session, job: Job, every: int) -> list[int]:
    stored = versions.stored_forms(db, job.id)
    drop = sorted(set(stored) - kept(job, stored, every))
    if drop:
        db.execute(update(WeightVersion).where(WeightVersion.job_id == job.id, WeightVersion.version.in_(drop))
                   .values(collected_at=utcnow()))
    return drop
