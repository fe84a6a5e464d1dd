"""How fast each weight version reached the workers: from announcement to the last targeted worker's
first report of holding it, or its proof for a version with probes (recorded by the heartbeat route in
`version_holds`: services/possession.py)."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from echo2.protocol import DesiredState, VersionRead, WorkerStatus
from sqlalchemy import Row, and_, select
from sqlalchemy.orm import Session

from ..models import VersionHold, WeightVersion, Worker

GONE = (WorkerStatus.offline, WorkerStatus.deregistered)
# Working on their job (Worker.job_id): the scheduler made them active and they have not gone.
ACTIVE = and_(Worker.desired == DesiredState.active, Worker.status.not_in(GONE))


def targets(db: Session, job_id: str) -> list[str]:
    """The workers a version announced now should reach: those active on the job."""
    return list(db.scalars(select(Worker.id).where(Worker.job_id == job_id, ACTIVE).order_by(Worker.id)))


def version_reads(db: Session, rows: list[WeightVersion]) -> list[VersionRead]:
    if not rows:
        return []
    held, now = _holdings(db, rows)
    return [_read(r, held[r.version], now) for r in rows]


def seconds(db: Session, rows: list[WeightVersion]) -> dict[int, float | None]:
    """Each version's dissemination time, None while a targeted worker is still fetching it (or it had none).
    Reads only the rows' job_id, version, targets and created_at."""
    if not rows:
        return {}
    held, now = _holdings(db, rows)
    return {r.version: _seconds(r, held[r.version], now) for r in rows}


def _holdings(db: Session, rows: list[WeightVersion]) -> tuple[dict[int, dict[str, datetime]], dict[str, Row[Any]]]:
    """When each worker first held each of these versions (of one job), and the targeted workers now."""
    job_id = rows[0].job_id
    held: dict[int, dict[str, datetime]] = defaultdict(dict)
    for h in db.execute(select(VersionHold.version, VersionHold.worker_id, VersionHold.held_at)
                        .where(VersionHold.job_id == job_id, VersionHold.version.in_([r.version for r in rows]))):
        held[h.version][h.worker_id] = h.held_at
    wanted = {w for r in rows for w in r.targets}
    now = {w.id: w for w in db.execute(select(Worker.id, Worker.job_id, Worker.status, Worker.version_held)
                                       .where(Worker.id.in_(wanted)))} if wanted else {}
    return held, now


def _read(row: WeightVersion, held: dict[str, datetime], now: dict[str, Row[Any]]) -> VersionRead:
    manifest = row.manifest if row.manifest is not None else row.delta_manifest
    return VersionRead.model_validate(row).model_copy(update={
        "adapter": bool(manifest and manifest.get("adapter")),
        "available": row.collected_at is None, "workers_targeted": len(row.targets),
        "workers_holding": len(held), "dissemination_s": _seconds(row, held, now)})


def _seconds(row: WeightVersion, held: dict[str, datetime], now: dict[str, Row[Any]]) -> float | None:
    reached = [held[w] for w in row.targets if w in held]
    waiting = [w for w in row.targets if w not in held and _still_fetching(now.get(w), row)]
    return (max(reached) - row.created_at).total_seconds() if reached and not waiting else None


def _still_fetching(worker: Row[Any] | None, row: WeightVersion) -> bool:
    return (worker is not None and worker.job_id == row.job_id and worker.status not in GONE
            and (worker.version_held is None or worker.version_held < row.version))
