"""Rollout archives: a group's token payloads (the prompt's token ids, the samples with their tokens and
logprobs, the learner's own logprobs) move out of the hot `rollouts` table into zstd-compressed Parquet files,
one per job and step range, under `{data_dir}/archive/{job id}/`, once nothing reads them from the table
again. The rows keep everything else (status, version, rewards, worker, audit, pay), so reports, ledgers,
billing and clawbacks read as before; what shows or replays tokens (`GET /v1/jobs/{id}/rollouts`, the traces,
the learner's replay of committed steps) reads them through `payloads`, from whichever place holds them.

What the API's retention sweep archives (`sweep`):
- a job that ended `after_h` hours ago: all its groups (it can no longer change);
- a running or paused job: its groups that are final and that no reader of the table will meet again:
  - trained at least `after_steps` steps before the job's step, and older than the job's newest
    `evidence.FLEET_WINDOW` trained groups (the fleet comparison reads their lengths every FLEET_EVERY steps;
    new groups are trained at the job's step, so that window only moves forward);
  - rejected at least `after_h` hours ago (a rejection is final; nothing but the two display routes reads it).
  Accepted and claimed groups stay: the learner's claim and the Tinker fleet's audits and answers read
  their tokens (the learner's audits are of claimed groups, their verdicts in before the group is trained).
  Pay is not waited for: billing and clawbacks read ids and counts only. A running job's groups go out
  `per_file` at a time (whole files, so that a slow job does not leave a small file every sweep); the rest
  waits for the next sweep or the job's end.

The file is written (to a temporary name, then renamed) before the rows change, in one transaction whose
update names only rows still in the table: a sweep that fails leaves the rows as they were and at most a file
nothing names, and of two API processes sweeping the same groups at once the second updates no row and
deletes its file (rows it shares with the first name whichever file committed first; both hold them).

Retention (`drop_expired`, ECHO2_ARCHIVE_KEEP_DAYS = d > 0): d days after a job ended, and once all its groups
are archived, its archive folder is deleted and its rows say when (`archive` = "deleted by retention on
YYYY-MM-DD"); reading their tokens then answers 410.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from echo2.protocol import JobStatus, RolloutStatus
from sqlalchemy import ColumnElement, and_, or_, select, true, update
from sqlalchemy.orm import Session

from ..errors import ApiError
from ..models import Job, Rollout, utcnow
from . import evidence

log = logging.getLogger(__name__)
GROUPS_PER_FILE = 5_000  # a file is read whole for a page of its groups: a few MB of tokens at most
DELETED = "deleted by retention on "  # then the date: the value of `Rollout.archive` once its file went


@dataclass(frozen=True)
class Payload:
    """A group's tokens, wherever they are kept."""

    prompt_token_ids: list[int]
    samples: list[dict[str, Any]]
    learner_logprobs: list[Any] | None


def archive_dir(data_dir: Path) -> Path:
    return data_dir / "archive"


def sweep(db: Session, data_dir: Path, after_h: float, after_steps: int, *,
          keep_trained: int = evidence.FLEET_WINDOW, per_file: int = GROUPS_PER_FILE) -> dict[str, int]:
    """Archive what the rule allows (module docstring) of every job with groups in the table.
    Returns the groups archived per job."""
    before = utcnow() - timedelta(hours=after_h)
    hot = select(Rollout.id).where(Rollout.job_id == Job.id, Rollout.archive.is_(None)).exists()
    done = {}
    for job in list(db.scalars(select(Job).where(hot))):
        rule = _archivable(db, job, before, after_steps, keep_trained)
        if rule is not None and (moved := _archive(db, data_dir, job.id, rule, per_file,
                                                   whole=not job.status.is_terminal())):
            done[job.id] = moved
    return done


def _archivable(db: Session, job: Job, before: datetime, after_steps: int,
                keep_trained: int) -> ColumnElement[bool] | None:
    """Which of the job's groups may leave the table now; None: none of them."""
    if job.status.is_terminal():
        return true() if job.finished_at is not None and job.finished_at <= before else None
    rejected = and_(Rollout.status == RolloutStatus.rejected, Rollout.created_at <= before)
    window = db.scalar(select(Rollout.trained_step)  # the oldest step in the fleet comparison's window
                       .where(Rollout.job_id == job.id, Rollout.status == RolloutStatus.trained)
                       .order_by(Rollout.trained_step.desc(), Rollout.id).offset(keep_trained - 1).limit(1))
    if window is None:
        return rejected
    last = min(window - 1, job.step - after_steps)
    return or_(rejected, and_(Rollout.status == RolloutStatus.trained, Rollout.trained_step <= last))


def _archive(db: Session, data_dir: Path, job_id: str, rule: ColumnElement[bool], per_file: int,
             whole: bool) -> int:
    """Move the job's groups the rule allows into files of at most `per_file` (exactly, when `whole`);
    returns the groups moved."""
    moved = 0
    while True:
        rows = list(db.scalars(select(Rollout).where(Rollout.job_id == job_id, Rollout.archive.is_(None), rule)
                               .order_by(Rollout.trained_step, Rollout.created_at, Rollout.id).limit(per_file)))
        if not rows or (whole and len(rows) < per_file):
            return moved
        moved += _move(db, data_dir, job_id, rows)


def _move(db: Session, data_dir: Path, job_id: str, rows: Sequence[Rollout]) -> int:
    name = _write(data_dir, job_id, rows)
    named = db.execute(update(Rollout).where(Rollout.id.in_([r.id for r in rows]), Rollout.archive.is_(None))
                       .values(archive=name, prompt_token_ids=[], samples=[], learner_logprobs=None)
                       .execution_options(synchronize_session=False)).rowcount
    db.commit()
    db.expire_all()
    if not named:  # another process archived them first: no row names this file
        (archive_dir(data_dir) / name).unlink()
    log.info("archived %d groups of job %s into %s", named, job_id, name)
    return named


def drop_expired(db: Session, data_dir: Path, keep_days: float) -> list[str]:
    """Delete the archives of jobs that ended `keep_days` ago (0: never) and have no group left in the table;
    their rows say so first, so none names a deleted file. Returns the jobs whose archives went."""
    root = archive_dir(data_dir)
    if not keep_days or not root.is_dir():
        return []
    hot = select(Rollout.id).where(Rollout.job_id == Job.id, Rollout.archive.is_(None)).exists()
    expired = list(db.scalars(select(Job.id).where(
        Job.id.in_([p.name for p in root.iterdir()]), Job.status.in_(JobStatus.ended()),
        Job.finished_at <= utcnow() - timedelta(days=keep_days), ~hot)))
    if expired:
        db.execute(update(Rollout).where(Rollout.job_id.in_(expired), Rollout.archive.is_not(None),
                                         Rollout.archive.not_like(f"{DELETED}%"))
                   .values(archive=f"{DELETED}{utcnow().date().isoformat()}"))
        db.commit()
    for job_id in expired:
        shutil.rmtree(root / job_id, ignore_errors=True)  # another API process's sweep may have been first
        log.info("deleted the rollout archive of job %s (ECHO2_ARCHIVE_KEEP_DAYS=%g)", job_id, keep_days)
    return expired


def _write(data_dir: Path, job_id: str, rows: Sequence[Rollout]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    steps = [r.trained_step for r in rows if r.trained_step is not None]
    span = f"{min(steps):07d}-{max(steps):07d}" if steps else "untrained"
    name = f"{job_id}/{span}-{secrets.token_hex(4)}.parquet"
    path = archive_dir(data_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({
        "id": [r.id for r in rows],
        "prompt_token_ids": pa.array([list(r.prompt_token_ids) for r in rows], pa.list_(pa.int64())),
        "samples": [json.dumps(r.samples, separators=(",", ":")) for r in rows],
        "learner_logprobs": [None if r.learner_logprobs is None else json.dumps(r.learner_logprobs) for r in rows],
    })
    staging = path.with_suffix(".partial")
    pq.write_table(table, staging, compression="zstd")
    with open(staging, "rb") as f:
        os.fsync(f.fileno())
    os.replace(staging, path)
    return name


def payloads(data_dir: Path, rows: Sequence[Rollout]) -> dict[str, Payload]:
    """Each row's tokens by rollout id: from the row, or from its archive file (one read per file)."""
    out = {r.id: Payload(list(r.prompt_token_ids), list(r.samples), r.learner_logprobs)
           for r in rows if r.archive is None}
    gone = [r for r in rows if r.archive is not None and r.archive.startswith(DELETED)]
    if gone:
        raise ApiError(410, f"the tokens of {len(gone)} of these groups (e.g. rollout {gone[0].id}) were "
                            f"{gone[0].archive} (ECHO2_ARCHIVE_KEEP_DAYS); the job's report and metrics remain "
                            f"(GET /v1/jobs/{gone[0].job_id}/report)")
    by_file: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        if r.archive is not None:
            by_file[r.archive].append(r.id)
    for name, ids in by_file.items():
        out |= _read(archive_dir(data_dir) / name, ids)
    return out


def _read(path: Path, ids: list[str]) -> dict[str, Payload]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not path.exists():
        raise ApiError(500, f"the archive file {path} holding {len(ids)} of these groups is missing; restore it "
                            "from backup (the rows say which file held what)")
    try:
        table = pq.read_table(path, filters=[("id", "in", ids)]).to_pylist()
    except (OSError, pa.ArrowException) as exc:  # truncated by a full disk, or a bad restore
        raise ApiError(500, f"the archive file {path} holding {len(ids)} of these groups cannot be read ({exc}); "
                            "restore it from backup (the rows say which file held what)") from exc
    found = {row["id"]: Payload(row["prompt_token_ids"], json.loads(row["samples"]),
                                None if row["learner_logprobs"] is None else json.loads(row["learner_logprobs"]))
             for row in table}
    if len(found) != len(set(ids)):
        raise ApiError(500, f"the archive file {path} lacks {len(set(ids)) - len(found)} of the groups that name it")
    return found
