"""The control plane checks reported relays itself: for a relay reported bad since its last probe, the
scheduler fetches a few chunks of the version it holds (with that version's relay key, as a peer would)
and hashes them against the manifest.

- A chunk with the wrong bytes confirms the report: the relay serves no peer any more, and its worker
  gets a strike (services/trust.py).
- Chunks with the right bytes prove nothing against the reports: a relay can tell the probe from a peer
  (its address) and serve each differently, so the reports of distinct providers still add up to the
  eviction threshold (services/relay.py). Voiding them on a good probe let such a relay feed peers garbage
  for good, each report wiped by the probe it started.
- A relay that does not answer, or answers slower than the deadline, is left as the reports say.
Each relay is probed again when a new report comes in. The fetches run after the tick has committed, outside
any transaction, at most PER_TICK relays a tick, together, each within DEADLINE_S in all and reading no more
than its chunk: a relay that answers one byte a second, or without end, cannot hold the tick (nor, on SQLite,
the database's write lock) past that.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from dataclasses import dataclass
from datetime import datetime

import httpx
from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from api.models import Job, RelayReport, WeightVersion, Worker
from api.services import trust
from api.services.fleet import relay_key
from api.settings import Settings

log = logging.getLogger(__name__)
PER_TICK = 3
CHUNKS = 3  # chunks fetched per probe, picked at random: a relay corrupting only some is found too
TIMEOUT_S = 2.0  # to connect, and between two reads
DEADLINE_S = 5.0  # for a relay's whole probe


@dataclass(frozen=True)
class Probe:
    worker_id: str
    relay_url: str
    key: str
    forms: list[tuple[str, list[dict[str, object]]]]  # (chunks URL, the manifest's chunks), delta first


def probe_reported(db: Session, settings: Settings, now: datetime) -> int:
    """Probe relays with reports newer than their last probe, committing before the fetches and after the
    verdicts; returns how many were probed."""
    probes = due(db, now)
    db.commit()
    for probe, verdict in zip(probes, fetch(probes), strict=True):
        record(db, settings, probe, verdict, now)
    db.commit()
    return len(probes)


def due(db: Session, now: datetime) -> list[Probe]:
    """Relays with reports newer than their last probe, marked probed now: what to fetch once the tick commits."""
    latest = (select(RelayReport.reported_worker_id, func.max(RelayReport.created_at).label("at"))
              .group_by(RelayReport.reported_worker_id).subquery())
    workers = list(db.scalars(
        select(Worker).join(latest, latest.c.reported_worker_id == Worker.id)
        .where(Worker.relay_confirmed_bad_at.is_(None), Worker.relay_url.is_not(None),
               or_(Worker.relay_probed_at.is_(None), Worker.relay_probed_at < latest.c.at))
        .limit(PER_TICK)))
    probes = []
    for worker in workers:
        worker.relay_probed_at = now
        if (probe := _plan(db, worker)) is not None:
            probes.append(probe)
    return probes


def _plan(db: Session, worker: Worker) -> Probe | None:
    """A relay serves the forms of the version it fetched (mostly the delta): each stored form is tried."""
    version = db.get(WeightVersion, (worker.job_id, worker.version_held)) if worker.job_id else None
    if version is None or version.collected_at is not None or worker.version_held is None:
        return None
    job = db.get_one(Job, worker.job_id)
    base = f"{worker.relay_url}/v1/jobs/{job.id}/versions/{version.version}"
    forms = [(f"{base}/delta/chunks", m["chunks"]) for m in [version.delta_manifest] if m is not None]
    forms += [(f"{base}/chunks", m["chunks"]) for m in [version.manifest] if m is not None]
    return Probe(worker.id, str(worker.relay_url), relay_key(job, version.version), forms)


def fetch(probes: list[Probe]) -> list[bool | None]:
    """Each relay's verdict, fetched at once: True, every chunk fetched was right; False, one was wrong; None,
    nothing could be checked. No database here: this runs outside any transaction."""
    async def every() -> list[bool | None]:
        return list(await asyncio.gather(*(_fetch(p) for p in probes)))

    return asyncio.run(every()) if probes else []


async def _fetch(probe: Probe) -> bool | None:
    checked: list[int] = []  # chunks found right, kept across the deadline
    try:
        async with asyncio.timeout(DEADLINE_S), httpx.AsyncClient(
                timeout=TIMEOUT_S, headers={"Authorization": f"Bearer {probe.key}"}) as http:
            for url, chunks in probe.forms:
                if (verdict := await _probe_form(http, probe.relay_url, url, chunks, checked)) is not None:
                    return verdict
    except (httpx.HTTPError, TimeoutError) as exc:
        log.info("relay %s did not answer a probe in time: %r", probe.relay_url, exc)
        return True if checked else None
    return None


def record(db: Session, settings: Settings, probe: Probe, verdict: bool | None, now: datetime) -> None:
    """A corrupt chunk confirms the reports; anything else leaves them as they are."""
    worker = db.get(Worker, probe.worker_id, with_for_update=True)  # its strikes as they are, not as last read
    if verdict is False and worker is not None and worker.relay_confirmed_bad_at is None:
        worker.relay_confirmed_bad_at = now
        trust.strike(db, worker, "its relay served a corrupt chunk (confirmed by the control plane)", settings)


async def _probe_form(http: httpx.AsyncClient, relay_url: str, url: str, chunks: list[dict[str, object]],
                      checked: list[int]) -> bool | None:
    for index in random.sample(range(len(chunks)), min(CHUNKS, len(chunks))):
        body = await _get(http, f"{url}/{index}", int(chunks[index]["size"]))  # type: ignore[call-overload]
        if body is None:
            continue
        if hashlib.sha256(body).hexdigest() != chunks[index]["sha256"]:
            log.warning("relay %s served a corrupt chunk %s/%d", relay_url, url, index)
            return False
        checked.append(index)
    return True if checked else None


async def _get(http: httpx.AsyncClient, url: str, size: int) -> bytes | None:
    """The chunk's bytes (None: not a 200), read as they come, no further than one byte past its size."""
    async with http.stream("GET", url) as r:
        if r.status_code != 200:
            return None
        body = bytearray()
        async for part in r.aiter_bytes():
            body += part
            if len(body) > size:
                break  # longer than the chunk: wrong whatever it holds
        return bytes(body)
