"""The control plane checks reported relays itself: for a relay reported bad since its last probe, the
scheduler fetches a few chunks of the version it holds (with that version's relay key, as a peer would)
and hashes them against the manifest.

- A chunk with the wrong bytes confirms the report: the relay serves no peer any more, and its worker
  gets a strike (services/trust.py).
- Chunks with the right bytes void the reports against it: whoever reported it was wrong or lying.
- A relay that does not answer is left as the reports say (a transient outage proves nothing); it is
  probed again when a new report comes in.
At most PER_TICK relays are probed per tick, each fetch with a short timeout, so a tick stays short.
"""

from __future__ import annotations

import hashlib
import logging
import random
from datetime import datetime

import httpx
from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from api.models import Job, RelayReport, WeightVersion, Worker
from api.services import relay, trust
from api.services.fleet import relay_key
from api.settings import Settings

log = logging.getLogger(__name__)
PER_TICK = 3
CHUNKS = 3  # chunks fetched per probe, picked at random: a relay corrupting only some is found too
TIMEOUT_S = 2.0


def probe_reported(db: Session, settings: Settings, now: datetime) -> int:
    """Probe relays with reports newer than their last probe; returns how many were probed."""
    latest = (select(RelayReport.reported_worker_id, func.max(RelayReport.created_at).label("at"))
              .group_by(RelayReport.reported_worker_id).subquery())
    due = list(db.scalars(
        select(Worker).join(latest, latest.c.reported_worker_id == Worker.id)
        .where(Worker.relay_confirmed_bad_at.is_(None), Worker.relay_url.is_not(None),
               or_(Worker.relay_probed_at.is_(None), Worker.relay_probed_at < latest.c.at))
        .limit(PER_TICK)))
    for worker in due:
        worker.relay_probed_at = now
        verdict = _probe(db, worker)
        if verdict is False:
            worker.relay_confirmed_bad_at = now
            trust.strike(db, worker, "its relay served a corrupt chunk (confirmed by the control plane)", settings)
        elif verdict is True:
            relay.clear_reports(db, worker)
    return len(due)


def _probe(db: Session, worker: Worker) -> bool | None:
    """True: every chunk fetched was right; False: one was wrong; None: nothing could be checked. A relay
    serves the forms of the version it fetched (mostly the delta): each stored form is tried."""
    version = db.get(WeightVersion, (worker.job_id, worker.version_held)) if worker.job_id else None
    if version is None or version.collected_at is not None or worker.version_held is None:
        return None
    job = db.get_one(Job, worker.job_id)
    headers = {"Authorization": f"Bearer {relay_key(job, version.version)}"}
    base = f"{worker.relay_url}/v1/jobs/{job.id}/versions/{version.version}"
    forms = [(f"{base}/delta/chunks", version.delta_manifest), (f"{base}/chunks", version.manifest)]
    with httpx.Client(timeout=TIMEOUT_S, headers=headers) as http:
        for url, manifest in forms:
            if manifest is not None and (verdict := _probe_form(http, worker, url, manifest["chunks"])) is not None:
                return verdict
    return None


def _probe_form(http: httpx.Client, worker: Worker, url: str, chunks: list[dict[str, object]]) -> bool | None:
    checked = 0
    for index in random.sample(range(len(chunks)), min(CHUNKS, len(chunks))):
        try:
            r = http.get(f"{url}/{index}")
        except httpx.HTTPError as exc:
            log.info("relay %s unreachable for a probe: %s", worker.relay_url, exc)
            return None if not checked else True
        if r.status_code != 200:
            continue
        if hashlib.sha256(r.content).hexdigest() != chunks[index]["sha256"]:
            log.warning("relay %s served a corrupt chunk %s/%d", worker.relay_url, url, index)
            return False
        checked += 1
    return True if checked else None
