"""Rollout archives: a finished job's token payloads (the prompt's token ids, the samples with their tokens and
logprobs, the learner's own logprobs) move out of the hot `rollouts` table into zstd-compressed Parquet files,
one per job and step range, under `{data_dir}/archive/{job id}/`. The rows keep everything else (status,
version, rewards, worker, audit, pay), so reports, ledgers and counts read as before; the two routes that show
tokens (`GET /v1/jobs/{id}/rollouts`, the traces) read them through `payloads`, from whichever place holds them.

Only jobs that ended are archived, `archive_after_h` hours after they did (the API's retention sweep): a
running job's groups are still read by admission, audits, fleet evidence and the Tinker fleet, and a finished job
can no longer change. The file is written (to a temporary name, then renamed) before the rows change, in one
transaction: a sweep that fails leaves the rows as they were and at most a file nothing names (as does a second
API process sweeping the same job at the same moment: the rows name the first file committed).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from echo2.protocol import JobStatus
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from ..errors import ApiError
from ..models import Job, Rollout, utcnow

log = logging.getLogger(__name__)
GROUPS_PER_FILE = 5_000  # a file is read whole for a page of its groups: a few MB of tokens at most
ENDED = [s for s in JobStatus if s.is_terminal()]


@dataclass(frozen=True)
class Payload:
    """A group's tokens, wherever they are kept."""

    prompt_token_ids: list[int]
    samples: list[dict[str, Any]]
    learner_logprobs: list[Any] | None


def archive_dir(data_dir: Path) -> Path:
    return data_dir / "archive"


def sweep(db: Session, data_dir: Path, after_h: float) -> dict[str, int]:
    """Archive every job that ended at least `after_h` hours ago and still has groups in the table.
    Returns the groups archived per job."""
    cutoff = utcnow() - timedelta(hours=after_h)
    left = select(Rollout.id).where(Rollout.job_id == Job.id, Rollout.archive.is_(None)).exists()
    jobs = db.scalars(select(Job).where(Job.status.in_(ENDED), Job.finished_at <= cutoff, left))
    done = {}
    for job in list(jobs):
        done[job.id] = archive_job(db, data_dir, job)
    return done


def archive_job(db: Session, data_dir: Path, job: Job) -> int:
    """Move this ended job's remaining token payloads into archive files; returns the groups moved."""
    if not job.status.is_terminal():
        raise ApiError(409, f"job {job.id} is {job.status}: only a job that ended is archived")
    moved = 0
    while True:
        rows = list(db.scalars(select(Rollout).where(Rollout.job_id == job.id, Rollout.archive.is_(None))
                               .order_by(Rollout.trained_step, Rollout.created_at, Rollout.id)
                               .limit(GROUPS_PER_FILE)))
        if not rows:
            return moved
        name = _write(data_dir, job.id, rows)
        db.execute(update(Rollout).where(Rollout.id.in_([r.id for r in rows]), Rollout.archive.is_(None))
                   .values(archive=name, prompt_token_ids=[], samples=[], learner_logprobs=None)
                   .execution_options(synchronize_session=False))
        db.commit()
        db.expire_all()
        moved += len(rows)
        log.info("archived %d groups of job %s into %s", len(rows), job.id, name)


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
    by_file: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        if r.archive is not None:
            by_file[r.archive].append(r.id)
    for name, ids in by_file.items():
        out |= _read(archive_dir(data_dir) / name, ids)
    return out


def _read(path: Path, ids: list[str]) -> dict[str, Payload]:
    import pyarrow.parquet as pq

    if not path.exists():
        raise ApiError(500, f"the archive file {path} holding {len(ids)} of these groups is missing; restore it "
                            "from backup (the rows say which file held what)")
    table = pq.read_table(path, filters=[("id", "in", ids)]).to_pylist()
    found = {row["id"]: Payload(row["prompt_token_ids"], json.loads(row["samples"]),
                                None if row["learner_logprobs"] is None else json.loads(row["learner_logprobs"]))
             for row in table}
    if len(found) != len(set(ids)):
        raise ApiError(500, f"the archive file {path} lacks {len(set(ids)) - len(found)} of the groups that name it")
    return found
