"""Heartbeats in group commits: one transaction for all the heartbeats that arrived meanwhile.

Every worker heartbeats every couple of seconds and each heartbeat writes, so this is the hottest
route. Handled one request per transaction, its cost is the per-request machinery (a thread hop
per dependency, a session, an ORM load and flush, a commit), not the row. Here the route (async:
no thread) queues the heartbeat and awaits its reply; one flusher at a time takes everything
queued (waiting GATHER_S first when few are), and in one thread and one transaction authenticates
each caller, writes all rows with one executemany, reads each job and its relay tree once, commits,
and only then answers every caller.
A reply still means "committed", and each caller still gets its own error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import anyio
import pydantic_core
from echo2.protocol import DesiredState, Heartbeat, HeartbeatReply, WorkerStatus
from sqlalchemy import Row, bindparam, select, text, update
from sqlalchemy.orm import Session

from .. import auth
from ..db import Database, among, insert_skipping_conflicts
from ..errors import ApiError, unauthorized
from ..models import Job, VersionHold, WeightVersion, Worker, utcnow
from ..settings import Settings
from . import fleet, relay, trust
from .possession import Claim, Possession

log = logging.getLogger(__name__)
MAX_BATCH = 256  # bounds one transaction's length, so a burst cannot hold the write lock for long
# A flusher that finds fewer than GATHER beats waiting first waits GATHER_S for more: otherwise, below what the
# process can do, each commit carries a few beats and costs nearly a whole transaction apiece. A beat is
# answered at most GATHER_S later; at the 2 s interval nobody notices. (Waiting longer, or until GATHER beats
# wait, measured no better: docs/BENCHMARKS.md.)
GATHER_S, GATHER = 0.005, 32


@dataclass
class _Pending:
    token: str
    worker_id: str
    hb: Heartbeat
    reply: asyncio.Future[HeartbeatReply]


class Heartbeats:
    """One per API process (app.state.heartbeats)."""

    def __init__(self, db: Database, settings: Settings) -> None:
        self.db, self.settings = db, settings
        self._queue: list[_Pending] = []
        self._flusher: asyncio.Task[None] | None = None

    async def submit(self, token: str, worker_id: str, hb: Heartbeat) -> HeartbeatReply:
        """Record a worker's heartbeat; returns the desired state once it is committed."""
        pending = _Pending(token, worker_id, hb, asyncio.get_running_loop().create_future())
        self._queue.append(pending)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await pending.reply

    async def _flush(self) -> None:
        while self._queue:
            if len(self._queue) < GATHER:
                await asyncio.sleep(GATHER_S)
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            try:
                results: Sequence[HeartbeatReply | Exception] = await anyio.to_thread.run_sync(self._write, batch)
            except Exception as exc:  # the transaction failed: every caller in it gets the error
                log.exception("heartbeat batch of %d failed", len(batch))
                results = [exc] * len(batch)
            for pending, result in zip(batch, results, strict=True):
                if pending.reply.done():  # the caller went away
                    continue
                if isinstance(result, Exception):
                    pending.reply.set_exception(result)
                else:
                    pending.reply.set_result(result)

    def _write(self, batch: list[_Pending]) -> list[HeartbeatReply | Exception]:
        now = utcnow()
        with self.db.session() as db:
            checked = _authenticate(db, batch)
            ok = [(p, row) for p, row in zip(batch, checked, strict=True) if not isinstance(row, ApiError)]
            replies = _apply(db, ok, now, self.settings) if ok else {}
            db.commit()
        return [replies[id(p)] if not isinstance(row, ApiError) else row for p, row in zip(batch, checked, strict=True)]


_Row = Row[Any]
# A Core executemany: the ORM bulk update by primary key it replaces adds per-row bookkeeping on the hottest path.
_BEAT = update(Worker.__table__).where(Worker.__table__.c.id == bindparam("b_id"))
# On PostgreSQL one statement a batch, its rows one JSON document: an executemany is still a statement per row
# to bind and run, and arrays are bound by Python code per element (docs/BENCHMARKS.md).
_PG_BEAT = text("""
UPDATE workers SET last_heartbeat_at = :now, version_held = b.version_held, versions_held = b.versions_held,
                   stats = b.stats, status = b.status
FROM json_to_recordset(CAST(:beats AS json))
     AS b(id varchar, version_held integer, versions_held json, stats json, status varchar)
WHERE workers.id = b.id""").bindparams(bindparam("now", type_=Worker.__table__.c.last_heartbeat_at.type))


def _authenticate(db: Session, batch: list[_Pending]) -> list[_Row | ApiError]:
    """Per heartbeat, the caller's worker row, or the error to answer it with (401/403, as other routes)."""
    identities = auth.lookup_many(db, [p.token for p in batch])
    ids = {i.principal_id for i in identities if i is not None and i.kind == "worker"}
    # Locked here, in id order: another API process's batch naming some of the same workers waits for this one
    # instead of deadlocking with it (the batch's writes come later, in whatever order their plan takes).
    rows = {r.id: r for r in db.execute(
        select(Worker.id, Worker.provider_id, Worker.status, Worker.job_id, Worker.desired, Worker.version_held,
               Worker.trust, Worker.quarantined_until, Worker.trust_reason, Worker.audit_salt)
        .where(among(db, Worker.id, ids)).order_by(Worker.id).with_for_update())} if ids else {}
    out: list[_Row | ApiError] = []
    for pending, identity in zip(batch, identities, strict=True):
        if identity is None:
            out.append(unauthorized("unknown or revoked token"))
        elif identity.kind != "worker":
            out.append(ApiError(403, f"this route needs a worker token, not a {identity.kind} token"))
        elif (row := rows.get(identity.principal_id)) is None or row.status == WorkerStatus.deregistered:
            out.append(unauthorized("this worker is deregistered; register again"))
        elif row.id != pending.worker_id:
            out.append(ApiError(403, "a worker may only heartbeat for itself"))
        else:
            out.append(row)
    return out


def _apply(db: Session, ok: list[tuple[_Pending, _Row]], now: datetime,
           settings: Settings) -> dict[int, HeartbeatReply]:
    jobs = {j.id: j for j in db.scalars(select(Job).where(Job.id.in_({r.job_id for _, r in ok if r.job_id})))}
    placed = {row.id: (row.job_id, row.desired) for _, row in ok}
    for worker_id, (job_id, _) in list(placed.items()):
        if job_id is not None and jobs[job_id].status.is_terminal():
            worker = db.get_one(Worker, worker_id)
            fleet.unassign(db, worker)
            placed[worker_id] = (None, worker.desired)
    db.flush()
    _record_holds(db, ok, placed, now)
    possession = Possession(db, [Claim(row.id, job_id, row.audit_salt, set(_held(p.hb, job_id)), p.hb.proofs)
                                 for p, row in ok if (job_id := placed[row.id][0]) is not None])
    struck = _strike(db, possession.check(db, now), placed, settings)
    db.flush()  # the strikes above first: the writes below are Core, which does not autoflush
    _write_beats(db, [(row.id, p.hb, placed[row.id][0]) for p, row in ok], now)
    for p, row in ok:
        relay.record(db, row.id, row.provider_id, placed[row.id][0], p.hb)
    return _replies(db, ok, placed, jobs, settings, possession, struck)


def _write_beats(db: Session, beats: list[tuple[str, Heartbeat, str | None]], now: datetime) -> None:
    """Each beat's row: when it beat, what it holds, its stats and status (a worker's last beat where a batch
    holds two of its beats: PostgreSQL updates a row once a statement)."""
    beats = list({worker_id: (worker_id, hb, job_id) for worker_id, hb, job_id in beats}.values())
    if db.get_bind().dialect.name == "postgresql":
        db.execute(_PG_BEAT, {"now": now, "beats": pydantic_core.to_json([
            {"id": worker_id, "version_held": hb.version_held, "versions_held": _held(hb, job_id), "stats": hb.stats,
             "status": hb.status} for worker_id, hb, job_id in beats]).decode()})
        return
    db.execute(_BEAT, [{"b_id": worker_id, "last_heartbeat_at": now, "version_held": hb.version_held,
                        "versions_held": _held(hb, job_id), "stats": hb.stats.model_dump(mode="json"),
                        "status": hb.status} for worker_id, hb, job_id in beats])


def _strike(db: Session, wrong: dict[str, str], placed: dict[str, tuple[str | None, str]],
            settings: Settings) -> dict[str, Worker]:
    """Strike each worker that answered a possession challenge wrong (rare: only a worker that lies does);
    a quarantine unassigns it, which its reply says."""
    struck = {}
    for worker_id, reason in wrong.items():
        worker = db.get_one(Worker, worker_id, with_for_update=True, populate_existing=True)  # strikes as they are
        trust.strike(db, worker, reason, settings)
        placed[worker_id], struck[worker_id] = (worker.job_id, worker.desired), worker
    return struck


def _held(hb: Heartbeat, job_id: str | None) -> list[int]:
    """The versions of `job_id` the worker holds: `versions_held`, and `version_held` from workers that only
    send that. Nothing when they are another job's (a worker moved to a new job still holds the old one's
    version 0, which is not the new job's version 0)."""
    if hb.job_id is not None and hb.job_id != job_id:
        return []
    held = set(hb.versions_held) | ({hb.version_held} if hb.version_held is not None else set())
    return sorted(held)


def _replies(db: Session, ok: list[tuple[_Pending, _Row]], placed: dict[str, tuple[str | None, str]],
             jobs: dict[str, Job], settings: Settings, possession: Possession,
             struck: dict[str, Worker]) -> dict[int, HeartbeatReply]:
    live = {job_id for job_id, _ in placed.values() if job_id is not None}
    makers = {job_id: fleet.assignment_for(db, jobs[job_id], settings) for job_id in live}
    trees = {job_id: fleet.RelayTree(db, job_id, settings) for job_id, make in makers.items() if make}
    server_time = utcnow()
    replies = {}
    for p, row in ok:
        job_id, desired = placed[row.id]
        make = makers.get(job_id) if job_id else None
        assignment = make(trees[job_id].parents(row.id), set(_held(p.hb, job_id)),
                          possession.challenges(row.id)) if make else None
        if desired == DesiredState.active and assignment is None:
            desired = DesiredState.idle  # active on a job with no published version yet: wait
        replies[id(p)] = HeartbeatReply(desired=desired, assignment=assignment,
                                        heartbeat_interval_s=settings.heartbeat_interval_s,
                                        server_time=server_time, notice=trust.notice(struck.get(row.id, row)))
    return replies


def _record_holds(db: Session, ok: list[tuple[_Pending, _Row]], placed: dict[str, tuple[str | None, str]],
                  now: datetime) -> None:
    """The first report of a newly held version of the worker's job (dissemination time); a version with
    probes is held once proven instead (services/possession.py)."""
    new = [(placed[row.id][0], p.hb.version_held, row.id) for p, row in ok
           if p.hb.version_held is not None and p.hb.version_held != row.version_held
           and placed[row.id][0] is not None and p.hb.job_id in (None, placed[row.id][0])]
    if not new:
        return
    unprobed = {(j, v) for j, v in db.execute(select(WeightVersion.job_id, WeightVersion.version).where(
        WeightVersion.job_id.in_({j for j, _, _ in new}), WeightVersion.version.in_({v for _, v, _ in new}),
        WeightVersion.probes.is_(None)))}  # one query a batch
    rows = [{"job_id": job_id, "version": version, "worker_id": worker_id, "held_at": now}
            for job_id, version, worker_id in new if (job_id, version) in unprobed]
    if rows:
        db.execute(insert_skipping_conflicts(db, VersionHold), rows)
