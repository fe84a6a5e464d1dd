"""Relay claims, earned rather than stated.

- Reports and measurements count only from workers on the relay's job (the only versions they download).
- Bad-source reports are weighed by reporter: one report per (relay, reporting provider), reports from
  the relay's own provider and from workers that may not work (quarantined, banned) do not count, and
  `bad_chunks` is the number of distinct providers left. A relay reported by ECHO2_RELAY_MAX_BAD_CHUNKS
  of them, or confirmed bad by the control plane fetching a chunk itself (scheduler/relay_probe.py),
  serves no peer. So one provider cannot evict another's relay, however often it reports.
- Upload rates are measured: a worker's heartbeat says what its last download took from each source,
  and each relay is credited with the rate workers of other providers saw: per provider an average
  weighted toward the latest, each download between 1 ms and 100 Gbit/s, and for the relay the median
  over providers, so one provider's invented figures move it only as far as the others let them. The
  relay tree is ordered by that, never by a claimed `upload_mbps`.
- In production a relay URL must be a public http(s) address.
"""

from __future__ import annotations

import ipaddress
import socket
import statistics
from urllib.parse import urlsplit

from echo2.protocol import Heartbeat, TrustState
from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from ..db import insert_skipping_conflicts
from ..errors import ApiError
from ..models import RelayMeasurement, RelayReport, Worker, utcnow

WORKING = TrustState.working()
MIN_MEASURED_BYTES = 1 << 20  # below this, a transfer says more about latency than about upload rate
MIN_MEASURED_S = 1e-3  # shorter is no measurement (5e-324 s made a rate of infinity, which no EMA brings down)
MAX_MEASURED_MBPS = 100_000.0  # 100 Gbit/s: no relay's uplink is faster
EMA = 0.3  # weight of the newest measurement


def record(db: Session, reporter_id: str, reporter_provider: str, job_id: str | None, hb: Heartbeat) -> None:
    """The reporter's bad-source reports and transfer measurements, attributed to the relays they name on the
    job it works on: a worker downloads only its own job's versions, so what an idle worker, or one of another
    job, says of a relay is not a download it made (one moved an honest relay from the root to the last place
    by reporting it slow from nowhere). Every relay of the job at that address is credited: an address another
    worker registered too (a decoy off the job) takes no report away from the relay that served it."""
    urls = {b.url.rstrip("/") for b in hb.bad_sources} | {f.url.rstrip("/") for f in hb.fetched_from}
    if not urls or job_id is None:
        return
    relays: dict[str, list[Worker]] = {}
    for w in db.scalars(select(Worker).where(Worker.relay_url.in_(urls), Worker.job_id == job_id)):
        if w.provider_id != reporter_provider and w.id != reporter_id:
            relays.setdefault(str(w.relay_url), []).append(w)
    reported = {w.id: (w, b.reason) for b in hb.bad_sources for w in relays.get(b.url.rstrip("/"), [])}
    if reported:
        db.execute(insert_skipping_conflicts(db, RelayReport), [
            {"reported_worker_id": wid, "reporter_worker_id": reporter_id, "reporter_provider_id": reporter_provider,
             "reason": reason[:512]} for wid, (_, reason) in reported.items()])
        for w, _ in reported.values():
            w.bad_chunks = distinct_reporters(db, w.id)
    for f in hb.fetched_from:
        if f.bytes >= MIN_MEASURED_BYTES and f.seconds >= MIN_MEASURED_S:
            rate = min(f.bytes * 8 / f.seconds / 1e6, MAX_MEASURED_MBPS)
            for relay in relays.get(f.url.rstrip("/"), []):
                _measured(db, relay, reporter_provider, rate)


def _measured(db: Session, relay: Worker, provider_id: str, rate: float) -> None:
    """The provider's figure for the relay moves toward `rate`; the relay's is the median of the providers'."""
    table = RelayMeasurement.__table__
    upsert = (pg_insert if db.get_bind().dialect.name == "postgresql" else sqlite_insert)(table).values(
        relay_worker_id=relay.id, provider_id=provider_id, mbps=rate, measured_at=utcnow())
    db.execute(upsert.on_conflict_do_update(
        index_elements=[table.c.relay_worker_id, table.c.provider_id],
        set_={"mbps": (1 - EMA) * table.c.mbps + EMA * rate, "measured_at": upsert.excluded.measured_at}))
    rates = db.scalars(select(RelayMeasurement.mbps).where(RelayMeasurement.relay_worker_id == relay.id)).all()
    relay.measured_upload_mbps = statistics.median(rates)


def distinct_reporters(db: Session, worker_id: str) -> int:
    """Other providers whose workers that may still work reported this relay."""
    return db.scalar(select(func.count(func.distinct(RelayReport.reporter_provider_id)))
                     .join(Worker, Worker.id == RelayReport.reporter_worker_id)
                     .where(RelayReport.reported_worker_id == worker_id, Worker.trust.in_(WORKING))) or 0


PEERS_CANNOT_REACH = "peers on the internet could not fetch from it (give the address they can reach)"


def check_public_url(url: str, field: str = "relay_url", why: str = PEERS_CANNOT_REACH) -> None:
    """422 unless `url` is http(s) on a host that resolves only to public addresses."""
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname or "", parts.port
    except ValueError as exc:  # "http://[::1", a port past 65535
        raise ApiError(422, f"{field} {url!r} is not a valid URL: {exc}", field=field) from None
    if parts.scheme not in ("http", "https") or not host:
        raise ApiError(422, f"{field} must be an http(s) URL with a host", field=field)
    for address in _addresses(host, field):
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 address may carry its interface
        if not ip.is_global or ip.is_multicast:
            raise ApiError(422, f"{field} {url} reaches {ip}, which is not a public address: {why}", field=field)


def _addresses(host: str, field: str) -> list[str]:
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None)})
    except (OSError, UnicodeError, ValueError):  # a label over 63 characters, an empty one ("a..b", ".")
        raise ApiError(422, f"{field} host {host!r} does not resolve", field=field) from None
