"""What a malicious peer can do to an honest worker: hostile relay parents (the downloader) and hostile
strangers (the worker's own relay server). Each test here failed before its fix: see the docstrings."""

from __future__ import annotations

import gzip
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest
from echo2_worker import relay as relay_module
from echo2_worker.fetch import Downloader
from echo2_worker.ratelimit import RateMeter
from echo2_worker.relay import RelayServer
from echo2_worker.store import VersionStore

from .conftest import HostileRelay
from .test_relay import JOB, KEY, fill_store, same_files


class _BlockMeter(RateMeter):
    """Records the largest block the downloader took in at once (it adds each block's length)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def add(self, n: int) -> None:
        self.largest = max(self.largest, n)
        super().add(n)


def test_a_compressed_answer_cannot_blow_up_past_the_chunk_size(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A peer answers every chunk with `Content-Encoding: gzip, gzip`: ~70 KB on the wire that httpx inflated in
    one decode call to 64 MiB (more layers or zstd: many GB) before `Downloader._get` compared the length with
    the chunk's size. The downloader reads the bytes as sent: they fail the chunk's check, the peer is banned."""
    origin_store, manifest = fill_store(tmp_path / "origin", tiny_model_dir)
    bomb = gzip.compress(gzip.compress(b"\x00" * (64 * 2**20), 9), 9)
    assert len(bomb) < 256 * 1024

    def answer(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Encoding", "gzip, gzip")
        h.send_header("Content-Length", str(len(bomb)))
        h.end_headers()
        h.wfile.write(bomb)

    peer = HostileRelay(answer)
    meter = _BlockMeter()
    try:
        with RelayServer(origin_store) as origin:
            dl = Downloader(VersionStore(tmp_path / "child"), origin_token=KEY, meter=meter, parallel=1)
            result = dl.fetch(JOB, manifest, [peer.url, origin.url], relay_key=KEY)
            dl.close()
    finally:
        peer.close()
    assert same_files(result.held.model_dir, tiny_model_dir)
    assert peer.requests >= 1
    # Never more than a chunk (plus one network read) in memory per request.
    assert meter.largest <= manifest.chunk_size + 256 * 1024, f"took in {meter.largest} bytes at once"


def test_a_peer_dripping_its_headers_cannot_hold_a_download_past_the_chunk_deadline(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """The per-chunk deadline (15 s + size / 128 KiB/s) was checked only between body blocks: a peer that sends
    its status line and then a header byte every 0.2 s never tripped the 20 s read timeout, and held the download
    thread until h11's 100 KB header limit (~6 h here), and with it any newer version's download. The deadline now
    bounds every socket read and write of the request (fetch._DeadlineBackend)."""
    origin_store, manifest = fill_store(tmp_path / "origin", tiny_model_dir)

    def answer(h: BaseHTTPRequestHandler) -> None:
        h.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        h.wfile.flush()
        while not peer.closed.is_set():
            h.wfile.write(b"a")
            h.wfile.flush()
            time.sleep(0.2)

    peer = HostileRelay(answer)
    outcome: dict = {}
    try:
        with RelayServer(origin_store) as origin:
            dl = Downloader(VersionStore(tmp_path / "child"), origin_token=KEY)
            t = threading.Thread(target=lambda: outcome.update(r=dl.fetch(JOB, manifest, [peer.url, origin.url],
                                                                          relay_key=KEY)), daemon=True)
            t.start()
            # Deadline for a 16 KiB chunk: 15.1 s; then the origin serves everything in well under a second.
            t.join(40)
            done = not t.is_alive()
    finally:
        peer.close()
    assert done, "the download is still stuck on a peer dripping its response headers"
    assert same_files(outcome["r"].held.model_dir, tiny_model_dir)


def test_strangers_cannot_hold_unbounded_relay_connections(tmp_path: Path, tiny_model_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Strangers (no relay key needed) opening connections that send half a request line each held a thread and
    a file handle for good: 40 of them held 40 threads with max_connections = 4. Now at most 2 x max + 16 are
    open at once, the rest closed at once, and a silent one is dropped after the idle timeout (1 s here)."""
    assert relay_module._Handler.timeout == relay_module.IDLE_S <= 60  # the stdlib's default: none
    monkeypatch.setattr(relay_module._Handler, "timeout", 1.0)
    store, _ = fill_store(tmp_path, tiny_model_dir)
    earlier = set(threading.enumerate())

    def serving() -> int:  # the relay's connection threads (socketserver names them by their target)
        return sum("process_request_thread" in t.name for t in threading.enumerate() if t not in earlier)

    with RelayServer(store, max_connections=4) as relay:
        strangers = []
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", relay.port))
            s.sendall(b"GET /healthz HT")  # and never the rest
            strangers.append(s)
        time.sleep(0.5)
        held = serving()
        time.sleep(2.0)
        left = serving()
        assert httpx.get(f"{relay.url}/healthz", timeout=5).status_code == 200
        for s in strangers:
            s.close()
    assert 0 < held <= 2 * 4 + 16 and left == 0, (held, left)


def test_a_child_that_stops_reading_does_not_hold_a_relay_slot_forever(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Any worker assigned the version has its relay key. It asked this relay for chunks larger than the socket
    buffers take and never read them: `_send_chunk` blocked in `wfile.write` with no socket timeout, holding one
    of `max_connections` slots for good, and with all held every honest child got 503 "relay busy". A write not
    taken within the idle timeout (2 s here) now drops the connection and its slot."""
    assert relay_module._Handler.timeout == relay_module.IDLE_S <= 60  # the stdlib's default: none
    monkeypatch.setattr(relay_module._Handler, "timeout", 2.0)
    import os

    from echo2.snapshots import build_manifest, iter_stream

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(os.urandom(24 * 2**20))
    manifest = build_manifest(folder, 0, 0, 16 * 2**20)
    store = VersionStore(tmp_path / "store")
    held = store.open(JOB, manifest, KEY)
    for i, data in enumerate(iter_stream(folder, manifest.files, manifest.chunk_size)):
        held.put(i, data)
    held.assemble()
    request = (f"GET /v1/jobs/{JOB}/versions/0/chunks/0 HTTP/1.1\r\nHost: r\r\n"
               f"Authorization: Bearer {KEY}\r\n\r\n").encode()
    with RelayServer(store, max_connections=2) as relay:
        hogs = []
        for _ in range(2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", relay.port))
            s.sendall(request)  # ...and never read the answer
            hogs.append(s)
        time.sleep(1.0)
        deadline, status = time.monotonic() + 20, None
        while time.monotonic() < deadline:
            status = httpx.get(f"{relay.url}/v1/jobs/{JOB}/versions/0/chunks/1",
                               headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code
            if status != 503:
                break
            time.sleep(1.0)
        for s in hogs:
            s.close()
    assert status == 200, f"an honest child still gets {status} after 20 s: two stalled readers hold the relay"
