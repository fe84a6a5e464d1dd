"""Relay download: fetch a version's chunks from the parents the control plane names, verify each
against the manifest before it is stored (and so before it is loaded or re-served), and fall back to
the next parent - the origin is last - when one is slow, failing or lying.

Parents are base URLs serving `/v1/jobs/{job}/versions/{v}[/delta]/chunks/{i}`, peers and origin alike. The
worker's token is sent to the origin only; a peer gets the version's relay key from the assignment.
A peer answering 404 does not hold that chunk yet (it may still be receiving it): it is asked again
for a short while before moving on. A hash mismatch bans the peer for this version; an error or a
stall puts it on a short cooldown. Both are reported (`on_bad_source`) so the next heartbeat can tell
the control plane.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpcore
import httpx
from echo2.protocol import Form, Manifest
from echo2.snapshots import SnapshotError
from echo2.transport import RetryPolicy

from .ratelimit import RateMeter
from .store import HeldVersion, VersionStore

log = logging.getLogger(__name__)

MIN_RATE = 128 * 1024  # bytes/s: a parent slower than this for a whole chunk counts as stalled
NOT_YET_POLL_S = 0.25
ROUND_PAUSES = RetryPolicy(initial_delay=0.5, max_delay=10.0)  # before another round when no source served a chunk


_deadline = threading.local()  # .at: when the calling thread's request must have ended, headers and body together


def _within(timeout: float | None) -> float | None:
    """A socket operation's timeout, shortened to what is left of the thread's deadline (ReadTimeout past it)."""
    end = getattr(_deadline, "at", None)
    if end is None:
        return timeout
    left = end - time.monotonic()
    if left <= 0:
        raise httpcore.ReadTimeout("past the chunk's deadline")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _within(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _within(timeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, _within(timeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's sockets, each read and write within the calling thread's deadline: httpx's timeouts are per
    read, so a peer sending its headers a byte at a time held a download thread for hours."""

    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_tcp(host, port, _within(timeout), local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_unix_socket(path, _within(timeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def _transport(limits: httpx.Limits) -> httpx.HTTPTransport:
    """httpx's transport on `_DeadlineBackend` (httpx takes no network backend: its pool is replaced). Proxies
    from the environment still apply: httpx mounts their own transports beside this one."""
    transport = httpx.HTTPTransport(limits=limits)
    transport._pool = httpcore.ConnectionPool(
        ssl_context=httpx.create_ssl_context(), max_connections=limits.max_connections,  # httpx's own defaults
        max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
        network_backend=_DeadlineBackend())
    return transport


class DownloadCancelled(Exception):
    """The version is no longer wanted (a newer one was announced, or the worker is draining)."""


class VersionUnavailable(Exception):
    """The origin no longer serves this version (or this worker may not read it)."""


@dataclass
class _Source:
    url: str
    is_origin: bool
    banned: bool = False
    cooldown_until: float = 0.0
    patience_s: float = 0.0

    def usable(self, now: float) -> bool:
        return not self.banned and now >= self.cooldown_until


@dataclass
class FetchResult:
    held: HeldVersion
    seconds: float
    bytes_from: dict[str, int] = field(default_factory=dict)
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)  # source -> (first start, last end)

    def seconds_from(self, url: str) -> float:
        start, end = self.spans[url]
        return end - start


def chunk_url(base: str, job_id: str, version: int, index: int, form: Form = Form.full) -> str:
    delta = "/delta" if form is Form.delta else ""
    return f"{base.rstrip('/')}/v1/jobs/{job_id}/versions/{version}{delta}/chunks/{index}"


class Downloader:
    """Fetches versions into a `VersionStore`. One instance per worker; `fetch` may run in a thread."""

    def __init__(self, store: VersionStore, *, origin_token: str | None = None,
                 on_bad_source: Callable[[str, str], None] | None = None, meter: RateMeter | None = None,
                 self_url: str | None = None, peer_patience_s: float = 5.0, cooldown_s: float = 10.0,
                 parallel: int = 4, timeout: httpx.Timeout | None = None) -> None:
        self.store = store
        self._origin_headers = {"Authorization": f"Bearer {origin_token}"} if origin_token else {}
        self._on_bad = on_bad_source or (lambda url, reason: None)
        self.meter = meter or RateMeter()
        self._self_url = self_url.rstrip("/") if self_url else None
        self.peer_patience_s = peer_patience_s
        self.cooldown_s = cooldown_s
        self.parallel = max(1, parallel)
        self._lock = threading.Lock()
        self._http = httpx.Client(timeout=timeout or httpx.Timeout(20.0, connect=5.0),
                                  transport=_transport(httpx.Limits(max_connections=4 * self.parallel,
                                                                    max_keepalive_connections=2 * self.parallel)))

    def close(self) -> None:
        self._http.close()

    def fetch(self, job_id: str, manifest: Manifest, parents: Callable[[], list[str]] | list[str],
              wanted: Callable[[], bool] = lambda: True, relay_key: str | None = None) -> FetchResult:
        """Hold every chunk of `manifest`, assemble the HF folder, and return it.

        `relay_key` is presented to peers and kept with the version for this worker's own relay.
        `parents()` is asked again for each chunk, so a changed relay tree takes effect mid-download.
        Up to `parallel` chunks are in flight at once, taken in index order, so a parent's per-request
        latency is hidden and children still receive the stream roughly in order (pipelining).
        Raises DownloadCancelled when `wanted()` turns false, VersionUnavailable when the origin says
        the version is gone.
        """
        t0 = time.monotonic()
        held = self.store.open(job_id, manifest, relay_key)
        result = FetchResult(held=held, seconds=0.0)
        sources: dict[str, _Source] = {}
        todo = iter(held.missing())
        failure: list[BaseException] = []

        def run() -> None:
            while not failure:
                with self._lock:
                    index = next(todo, None)
                if index is None:
                    return
                try:
                    current = self._sources(parents() if callable(parents) else parents, sources)
                    self._fetch_chunk(held, index, current, lambda: wanted() and not failure, result)
                except BaseException as exc:  # first failure stops the others; re-raised below
                    failure.append(exc)

        threads = [threading.Thread(target=run, name=f"echo2-fetch-{i}", daemon=True)
                   for i in range(min(self.parallel, len(held.missing())))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failure:
            raise failure[0]
        held.assemble()
        result.seconds = time.monotonic() - t0
        return result

    def _sources(self, urls: list[str], known: dict[str, _Source]) -> list[_Source]:
        urls = [u.rstrip("/") for u in urls if u]
        out = []
        with self._lock:
            for i, url in enumerate(urls):
                if url == self._self_url:
                    continue
                if url not in known:
                    known[url] = _Source(url, is_origin=i == len(urls) - 1, patience_s=self.peer_patience_s)
                out.append(known[url])
        return out

    def _fetch_chunk(self, held: HeldVersion, index: int, sources: list[_Source], wanted: Callable[[], bool],
                     result: FetchResult) -> None:
        attempt = 0
        while True:
            if not wanted():
                raise DownloadCancelled(f"version {held.version} is no longer wanted")
            now = time.monotonic()
            for src in [s for s in sources if s.usable(now)]:
                started = time.monotonic()
                if self._try(src, held, index, wanted):
                    with self._lock:
                        size = held.manifest.chunks[index].size
                        result.bytes_from[src.url] = result.bytes_from.get(src.url, 0) + size
                        first, _ = result.spans.get(src.url, (started, started))
                        result.spans[src.url] = (min(first, started), time.monotonic())
                    return
            # Nobody could serve it (the origin too): wait, bounded, then go round again.
            delay = ROUND_PAUSES.backoff(attempt)
            log.warning("chunk %d of version %d: no parent could serve it; retrying in %.1fs", index,
                        held.version, delay)
            time.sleep(delay)
            attempt += 1

    def _try(self, src: _Source, held: HeldVersion, index: int, wanted: Callable[[], bool]) -> bool:
        """One source, asked (and re-asked while it says "not yet" and has patience left)."""
        url = chunk_url(src.url, held.job_id, held.version, index, held.form)
        while True:
            if held.has(index):
                return True
            try:
                status, data = self._get(url, self._headers(src, held), held.manifest.chunks[index].size)
            except httpx.HTTPError as exc:
                return self._failed(src, f"chunk {index}: {type(exc).__name__}: {exc}"[:400])
            if status == 200:
                try:
                    held.put(index, data)
                except SnapshotError as exc:
                    return self._lied(src, str(exc))
                return True
            if src.is_origin and status in (401, 403, 404, 410):
                raise VersionUnavailable(f"origin answered {status} for chunk {index} of version {held.version}")
            if status == 404 and not src.is_origin and src.patience_s > 0 and wanted():
                time.sleep(NOT_YET_POLL_S)  # the peer may still be receiving this chunk
                src.patience_s -= NOT_YET_POLL_S
                continue
            if status == 404:
                return False  # this peer does not have it: try the next parent
            return self._failed(src, f"chunk {index}: HTTP {status}")

    def _headers(self, src: _Source, held: HeldVersion) -> dict[str, str]:
        if src.is_origin:
            return self._origin_headers
        return {"Authorization": f"Bearer {held.relay_key}"} if held.relay_key else {}

    def _get(self, url: str, headers: dict[str, str], size: int) -> tuple[int, bytes]:
        _deadline.at = time.monotonic() + 15.0 + size / MIN_RATE  # for the whole request: _DeadlineBackend
        try:
            return self._read(url, headers, size)
        finally:
            _deadline.at = None

    def _read(self, url: str, headers: dict[str, str], size: int) -> tuple[int, bytes]:
        with self._http.stream("GET", url, headers=headers) as response:
            if response.status_code != 200:
                return response.status_code, b""
            buf = bytearray()
            # The bytes as sent, never decoded: a peer's "Content-Encoding: gzip, gzip" made 70 KB into 64 MiB in
            # memory before the size was checked. Encoded bytes fail the chunk's sha256 like any other wrong ones.
            for block in response.iter_raw():
                buf += block
                self.meter.add(len(block))
                if len(buf) > size:
                    break  # longer than the manifest says: verification will reject it
            return 200, bytes(buf)

    def _failed(self, src: _Source, reason: str) -> bool:
        log.warning("parent %s failed: %s", src.url, reason)
        if not src.is_origin:  # the origin is never skipped: the round's backoff paces retries to it
            src.cooldown_until = time.monotonic() + self.cooldown_s
            self._on_bad(src.url, reason)
        return False

    def _lied(self, src: _Source, reason: str) -> bool:
        log.warning("parent %s served a bad chunk (%s); not using it again for this version", src.url, reason)
        if src.is_origin:
            src.cooldown_until = time.monotonic() + self.cooldown_s
        else:
            src.banned = True
            self._on_bad(src.url, reason)
        return False
