"""Relay claims, earned rather than stated.

- Bad-source reports are weighed by reporter: one report per (relay, reporting provider), reports from
  the relay's own provider and from workers that may not work (quarantined, banned) do not count, and
  `bad_chunks` is the number of distinct providers left. A relay reported by ECHO2_RELAY_MAX_BAD_CHUNKS
  of them, or confirmed bad by the control plane fetching a chunk itself (scheduler/relay_probe.py),
  serves no peer. So one provider cannot evict another's relay, however often it reports.
- Upload rates are measured: a worker's heartbeat says what its last download took from each source,
  and each relay is credited with the rate workers of other providers saw (an average weighted toward
  the latest). The relay tree is ordered by that, never by a claimed `upload_mbps`.
- In production a relay URL must be a public http(s) address.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from echo2.protocol import Heartbeat, TrustState
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..db import insert_skipping_conflicts
from ..errors import ApiError
from ..models import RelayReport, Worker

WORKING = [s for s in TrustState if s.can_work()]
MIN_MEASURED_BYTES = 1 << 20  # below this, a transfer says more about latency than about upload rate
EMA = 0.3  # weight of the newest measurement


def record(db: Session, reporter_id: str, reporter_provider: str, hb: Heartbeat) -> None:
    """The reporter's bad-source reports and transfer measurements, attributed to the relays they name."""
    urls = {b.url.rstrip("/") for b in hb.bad_sources} | {f.url.rstrip("/") for f in hb.fetched_from}
    if not urls:
        return
    relays = {w.relay_url: w for w in db.scalars(select(Worker).where(Worker.relay_url.in_(urls)))
              if w.provider_id != reporter_provider and w.id != reporter_id}
    reported = [(relays[b.url.rstrip("/")], b.reason) for b in hb.bad_sources if b.url.rstrip("/") in relays]
    if reported:
        db.execute(insert_skipping_conflicts(db, RelayReport), [
            {"reported_worker_id": w.id, "reporter_worker_id": reporter_id, "reporter_provider_id": reporter_provider,
             "reason": reason[:512]} for w, reason in reported])
        for w in {w.id: w for w, _ in reported}.values():
            w.bad_chunks = distinct_reporters(db, w.id)
    for f in hb.fetched_from:
        relay = relays.get(f.url.rstrip("/"))
        if relay is not None and f.bytes >= MIN_MEASURED_BYTES and f.seconds > 0:
            rate = f.bytes * 8 / f.seconds / 1e6
            old = relay.measured_upload_mbps
            relay.measured_upload_mbps = rate if old is None else (1 - EMA) * old + EMA * rate


def distinct_reporters(db: Session, worker_id: str) -> int:
    """Other providers whose workers that may still work reported this relay."""
    return db.scalar(select(func.count(func.distinct(RelayReport.reporter_provider_id)))
                     .join(Worker, Worker.id == RelayReport.reporter_worker_id)
                     .where(RelayReport.reported_worker_id == worker_id, Worker.trust.in_(WORKING))) or 0


def clear_reports(db: Session, worker: Worker) -> None:
    """The control plane fetched a good chunk from this relay: the reports against it are void."""
    db.execute(RelayReport.__table__.delete().where(RelayReport.reported_worker_id == worker.id))
    worker.bad_chunks = 0


PEERS_CANNOT_REACH = "peers on the internet could not fetch from it (give the address they can reach)"


def check_public_url(url: str, field: str = "relay_url", why: str = PEERS_CANNOT_REACH) -> None:
    """422 unless `url` is http(s) on a host that resolves only to public addresses."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        raise ApiError(422, f"{field} must be an http(s) URL with a host", field=field)
    for address in _addresses(host, field):
        ip = ipaddress.ip_address(address)
        if not ip.is_global or ip.is_multicast:
            raise ApiError(422, f"{field} {url} reaches {ip}, which is not a public address: {why}", field=field)


def _addresses(host: str, field: str) -> list[str]:
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None)})
    except OSError:
        raise ApiError(422, f"{field} host {host!r} does not resolve", field=field) from None
