"""The relay server: serves every verified chunk this worker holds to its children in the relay tree,
over plain HTTP on the origin's paths, while later chunks are still arriving.

    GET /v1/jobs/{job}/versions/{v}/chunks/{i}         a chunk of the full form (Range supported), sha256 in
                                                       X-Echo2-Sha256
    GET /v1/jobs/{job}/versions/{v}/delta/chunks/{i}   a chunk of the delta
    GET /v1/jobs/{job}/versions/{v}[/delta]/manifest   the manifest this worker verifies against
    GET /healthz

A chunk that is not here yet, of a version being received, is waited for up to `wait_s` (pipelining);
otherwise the answer is 404 with Retry-After, and the child asks again or goes to another parent.
Upload is paced by one token bucket shared by all connections. Every version path needs
`Authorization: Bearer <relay key>`, the key the control plane gave this worker with that version
(401 without one; another key reads as a version not held here, so an outsider cannot tell which versions
a worker holds): the weights are the job owner's, and only workers assigned to the version know its key.
Integrity does not rest on the relay: children verify every chunk against the manifest they fetch from the
origin.
Stdlib only (ThreadingHTTPServer), so the worker needs no web framework.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from echo2.protocol import Form

from .ratelimit import RateMeter, TokenBucket
from .store import VersionStore

log = logging.getLogger(__name__)

SHA_HEADER = "X-Echo2-Sha256"
_ROUTE = re.compile(r"^/v1/jobs/([A-Za-z0-9_\-]{1,64})/versions/(\d{1,8})(/delta)?/(manifest|chunks/(\d{1,7}))$")
_RANGE = re.compile(r"^bytes=(\d{0,12})-(\d{0,12})$")  # no chunk is a terabyte; 4,300 digits made int() raise
WRITE_SLICE = 64 * 1024
IDLE_S = 30.0  # a connection silent this long, or a write of WRITE_SLICE not taken this long, is dropped


class RelayServer:
    """Serve a `VersionStore` on host:port (port 0 picks a free one) in a background thread."""

    def __init__(self, store: VersionStore, host: str = "127.0.0.1", port: int = 0, *,
                 upload_bytes_per_s: float | None = None, meter: RateMeter | None = None, wait_s: float = 10.0,
                 max_connections: int = 128, advertise_host: str | None = None) -> None:
        self.store = store
        self.bucket = TokenBucket(upload_bytes_per_s)
        self.meter = meter or RateMeter()
        self.wait_s = wait_s
        self.served_chunks = 0
        self._slots = threading.BoundedSemaphore(max_connections)
        self._httpd = _Server((host, port), _handler_class(self), open_at_most=2 * max_connections + 16)
        self._httpd.daemon_threads = True
        self._advertise = advertise_host or host
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host = self._advertise
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def start(self) -> RelayServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="echo2-relay", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> RelayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    """Each connection is a thread: at most `open_at_most` at once, past which a new one is closed at once (strangers
    holding silent connections used to take a thread and a file handle each, for good)."""

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *, open_at_most: int) -> None:
        super().__init__(address, handler)
        self._open = threading.BoundedSemaphore(open_at_most)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._open.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._open.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._open.release()

    def handle_error(self, request: object, client_address: tuple[str, int]) -> None:
        """Through logging (JSON when the worker logs JSON), not the stdlib's traceback on stderr; a peer that
        resets a kept-alive connection is routine: one line."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.info("relay: %s hung up", client_address[0])
        else:
            log.exception("relay: serving %s failed", client_address[0])


def _handler_class(relay: RelayServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        pass

    Handler.relay = relay
    return Handler


class _Handler(BaseHTTPRequestHandler):
    relay: RelayServer
    protocol_version = "HTTP/1.1"
    server_version = "echo2-relay"
    # A socket timeout on every read and write: a connection that sends no request, or a child that stops reading
    # a chunk, lets go of its thread and its slot after this long (each write is one WRITE_SLICE).
    timeout = IDLE_S

    def setup(self) -> None:
        super().setup()
        # Headers and body go out as separate writes: without this, Nagle + delayed ACK add ~40 ms per chunk.
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib signature)
        log.debug("relay %s " + format, self.client_address[0], *args)

    def do_GET(self) -> None:  # noqa: N802 (stdlib name)
        if not self.relay._slots.acquire(blocking=False):
            self._problem(503, "relay busy", retry_after=1)
            return
        try:
            self._get()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the child went away; it will ask again elsewhere
        finally:
            self.relay._slots.release()

    def _get(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self._send(200, json.dumps({"status": "ok"}).encode(), "application/json")
            return
        m = _ROUTE.match(path)
        if m is None:
            self._problem(404, "no such path on a relay")
            return
        given = _bearer(self.headers.get("Authorization"))
        if given is None:
            self._problem(401, "send the version's relay key (from your assignment) as a Bearer token",
                          headers={"WWW-Authenticate": "Bearer"})
            return
        job_id, version, form = m.group(1), int(m.group(2)), Form.delta if m.group(3) else Form.full
        held = self.relay.store.get(job_id, version, form)
        # Another key is answered as a version not held: which versions a worker holds is no outsider's business.
        if held is None or held.relay_key is None or not hmac.compare_digest(given.encode(), held.relay_key.encode()):
            self._problem(404, f"the {form.value} form of version {version} of {job_id} is not held here (yet)",
                          retry_after=1)
            return
        if m.group(4) == "manifest":
            self._send(200, held.manifest.model_dump_json().encode(), "application/json")
            return
        index = int(m.group(5))
        if index >= held.num_chunks:
            self._problem(404, f"version {version} has {held.num_chunks} chunks; no chunk {index}")
            return
        if not held.wait_for(index, self.relay.wait_s):
            self._problem(404, f"chunk {index} has not arrived here yet", retry_after=1)
            return
        try:
            data = held.read(index)
        except (KeyError, FileNotFoundError):
            self._problem(404, f"chunk {index} is no longer held here")
            return
        self._send_chunk(data, held.manifest.chunks[index].sha256)
        self.relay.served_chunks += 1

    def _send_chunk(self, data: bytes, sha256: str) -> None:
        start, end, status = 0, len(data), 200
        ranged = self.headers.get("Range")
        if ranged:
            m = _RANGE.match(ranged.strip())
            if m is None or (not m.group(1) and not m.group(2)):
                self._problem(416, "unsupported Range")
                return
            if m.group(1):
                start = int(m.group(1))
                end = min(len(data), int(m.group(2)) + 1) if m.group(2) else len(data)
            else:
                start = max(0, len(data) - int(m.group(2)))
            if start >= end:
                self._problem(416, "Range not satisfiable")
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header(SHA_HEADER, sha256)
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
        view = memoryview(data)[start:end]
        for offset in range(0, len(view), WRITE_SLICE):
            piece = view[offset : offset + WRITE_SLICE]
            self.relay.bucket.consume(len(piece))
            self.wfile.write(piece)
            self.relay.meter.add(len(piece))

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _problem(self, status: int, detail: str, retry_after: int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        body = json.dumps({"type": "about:blank", "title": self.responses.get(status, ("Error",))[0],
                           "status": status, "detail": detail}).encode()
        headers = dict(headers or {})
        if retry_after is not None:
            headers["Retry-After"] = str(retry_after)
        self._send(status, body, "application/problem+json", headers)


def _bearer(header: str | None) -> str | None:
    scheme, _, token = (header or "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None
