"""The relay on its own: verified chunks only, pipelined serving, the upload cap, fallback from a lying
or killed parent, the per-version relay key. Origins here are RelayServers over a complete store (same
paths as the API); the downloader presents the key to them as its origin token."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from echo2.snapshots import SnapshotError, build_manifest, iter_stream
from echo2_worker.fetch import Downloader
from echo2_worker.ratelimit import TokenBucket
from echo2_worker.relay import RelayServer
from echo2_worker.store import VersionStore

from .conftest import LyingRelay, wait_for

JOB = "job_relaytest"
CHUNK = 16 * 1024
KEY = "k" * 64
AUTH = {"Authorization": f"Bearer {KEY}"}


def fill_store(root: Path, folder: Path, version: int = 0, chunk: int = CHUNK):
    manifest = build_manifest(folder, version, 0, chunk)
    store = VersionStore(root)
    held = store.open(JOB, manifest, KEY)
    for i, data in enumerate(iter_stream(folder, manifest.files, chunk)):
        held.put(i, data)
    held.assemble()
    return store, manifest


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.name != "manifest.json")
    return all(hashlib.sha256((a / n).read_bytes()).digest() == hashlib.sha256((b / n).read_bytes()).digest()
               for n in names)


def test_store_refuses_bad_chunks_and_serves_assembled_bytes(tmp_path: Path, tiny_model_dir: Path) -> None:
    store, manifest = fill_store(tmp_path / "s", tiny_model_dir)
    held = store.get(JOB, 0)
    assert held is not None and held.complete and same_files(held.model_dir, tiny_model_dir)
    assert not (held.path / "chunks").exists()  # chunks are dropped once the folder is assembled
    stream = list(iter_stream(tiny_model_dir, manifest.files, CHUNK))
    assert [held.read(i) for i in range(held.num_chunks)] == stream
    fresh = VersionStore(tmp_path / "t").open(JOB, manifest)
    with pytest.raises(SnapshotError):
        fresh.put(0, b"\x00" * manifest.chunks[0].size)
    assert not fresh.has(0) and not (fresh.path / "chunks" / "0").exists()


def test_relay_serves_while_receiving(tmp_path: Path, tiny_model_dir: Path) -> None:
    manifest = build_manifest(tiny_model_dir, 0, 0, CHUNK)
    chunks = list(iter_stream(tiny_model_dir, manifest.files, CHUNK))
    store = VersionStore(tmp_path)
    held = store.open(JOB, manifest, KEY)
    http = httpx.Client(headers=AUTH)
    with RelayServer(store, wait_s=10.0) as relay:
        base = f"{relay.url}/v1/jobs/{JOB}/versions/0"
        held.put(0, chunks[0])
        assert http.get(f"{base}/chunks/0").content == chunks[0]
        got: dict[str, bytes] = {}
        asker = threading.Thread(target=lambda: got.update(c=http.get(f"{base}/chunks/3", timeout=20).content))
        asker.start()
        time.sleep(0.3)
        assert asker.is_alive()  # waiting for chunk 3, which has not arrived yet
        held.put(3, chunks[3])
        asker.join(15)
        assert got["c"] == chunks[3]
        relay.wait_s = 1.0
        r = http.get(f"{base}/chunks/1", headers={"Range": "bytes=10-19"})
        assert r.status_code == 404 and r.headers["retry-after"] == "1"  # still missing after wait_s
        held.put(1, chunks[1])
        r = http.get(f"{base}/chunks/1", headers={"Range": "bytes=10-19"})
        assert r.status_code == 206 and r.content == chunks[1][10:20]
        assert http.get(f"{base}/manifest").json()["version"] == 0
        assert http.get(f"{relay.url}/v1/jobs/{JOB}/versions/7/chunks/0").status_code == 404


def test_relay_serves_a_version_only_for_its_key(tmp_path: Path, tiny_model_dir: Path) -> None:
    store, manifest = fill_store(tmp_path, tiny_model_dir)
    unkeyed = store.open("job_other", manifest)  # held without a key (e.g. opened before one was given)
    unkeyed.put(0, next(iter_stream(tiny_model_dir, manifest.files, CHUNK)))
    with RelayServer(store) as relay:
        chunk = f"{relay.url}/v1/jobs/{JOB}/versions/0/chunks/0"
        r = httpx.get(chunk)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer" and "relay key" in r.json()["detail"]
        assert httpx.get(f"{relay.url}/v1/jobs/{JOB}/versions/0/manifest").status_code == 401
        # Another key reads as a version not held here, word for word: an outsider with any key cannot tell
        # which versions a worker holds (it answered 403 for a held version, 404 for another).
        other = {"Authorization": "Bearer " + "x" * 64}
        wrong = httpx.get(chunk, headers=other)
        unheld = httpx.get(f"{relay.url}/v1/jobs/{JOB}/versions/5/chunks/0", headers=other)
        assert wrong.status_code == unheld.status_code == 404 and wrong.headers["retry-after"] == "1"
        assert wrong.json()["detail"] == unheld.json()["detail"].replace("version 5", "version 0")
        assert httpx.get(chunk, headers={"Authorization": f"Basic {KEY}"}).status_code == 401
        assert httpx.get(chunk, headers=AUTH).status_code == 200
        assert httpx.get(f"{relay.url}/v1/jobs/job_other/versions/0/chunks/0", headers=AUTH).status_code == 404
        assert httpx.get(f"{relay.url}/healthz").status_code == 200


def test_downloader_sends_the_relay_key_to_peers_and_the_token_to_the_origin(tmp_path: Path,
                                                                             tiny_model_dir: Path) -> None:
    origin_store, manifest = fill_store(tmp_path / "origin", tiny_model_dir)
    origin_store.get(JOB, 0).relay_key = "o" * 64  # stands in for the worker's token at the API
    parent_store, _ = fill_store(tmp_path / "parent", tiny_model_dir)
    with RelayServer(origin_store) as origin, RelayServer(parent_store) as parent:
        results = []
        for child, parents in (("via-peer", [parent.url, origin.url]), ("via-origin", [origin.url])):
            dl = Downloader(VersionStore(tmp_path / child), origin_token="o" * 64)
            results.append(dl.fetch(JOB, manifest, parents, relay_key=KEY))
            dl.close()
    assert results[0].bytes_from == {parent.url: manifest.total_size}  # a wrong header would have been a 403
    assert results[1].bytes_from == {origin.url: manifest.total_size}
    assert results[0].held.relay_key == KEY  # what this worker's own relay will ask its children for


def test_upload_cap(tmp_path: Path, tiny_model_dir: Path) -> None:
    store, manifest = fill_store(tmp_path, tiny_model_dir, chunk=256 * 1024)
    rate = 1_000_000
    with RelayServer(store, upload_bytes_per_s=rate) as relay:
        t0 = time.monotonic()
        total = sum(len(httpx.get(f"{relay.url}/v1/jobs/{JOB}/versions/0/chunks/{i}", headers=AUTH).content)
                    for i in range(3))
        elapsed = time.monotonic() - t0
    assert total == 3 * 256 * 1024
    assert elapsed >= (total - relay.bucket.burst) / rate * 0.95
    bucket = TokenBucket(2e6)
    t0 = time.monotonic()
    for _ in range(20):
        bucket.consume(100_000)
    assert time.monotonic() - t0 >= (2e6 - bucket.burst) / 2e6 * 0.95


def test_lying_parent_is_banned_reported_and_never_stored(tmp_path: Path, tiny_model_dir: Path) -> None:
    origin_store, manifest = fill_store(tmp_path / "origin", tiny_model_dir)
    liar = LyingRelay(lambda job, v, i: manifest.chunks[i].size if i < len(manifest.chunks) else None)
    reports: list[tuple[str, str]] = []
    with RelayServer(origin_store) as origin:
        store = VersionStore(tmp_path / "child")
        dl = Downloader(store, origin_token=KEY, on_bad_source=lambda u, r: reports.append((u, r)))
        result = dl.fetch(JOB, manifest, [liar.url, origin.url], relay_key=KEY)
        dl.close()
    liar.close()
    assert same_files(result.held.model_dir, tiny_model_dir)
    assert 1 <= liar.requests <= dl.parallel  # banned after the bad chunks already in flight
    assert {u for u, _ in reports} == {liar.url} and all("sha256" in r for _, r in reports)
    assert result.bytes_from == {origin.url: manifest.total_size}


PARENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from echo2.protocol import Manifest
    from echo2_worker.relay import RelayServer
    from echo2_worker.store import VersionStore
    root, job, rate, key = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]
    store = VersionStore(root)
    for mf in root.glob("*/v*/manifest.json"):
        store.open(mf.parent.parent.name, Manifest.model_validate_json(mf.read_bytes()), key)
    relay = RelayServer(store, upload_bytes_per_s=rate).start()
    print(relay.url, flush=True)
    time.sleep(3600)
""")


def test_parent_killed_mid_transfer_costs_one_retry(tmp_path: Path, tiny_model_dir: Path) -> None:
    origin_store, manifest = fill_store(tmp_path / "origin", tiny_model_dir)
    fill_store(tmp_path / "parent", tiny_model_dir)
    rate = 200_000  # the parent trickles, so the kill lands mid-download
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "parent"), JOB, str(rate), KEY],
                              stdout=subprocess.PIPE, text=True)
    try:
        parent_url = parent.stdout.readline().strip()
        reports: list[tuple[str, str]] = []
        with RelayServer(origin_store) as origin:
            store = VersionStore(tmp_path / "child")
            dl = Downloader(store, origin_token=KEY, on_bad_source=lambda u, r: reports.append((u, r)))
            result: dict = {}
            t = threading.Thread(target=lambda: result.update(
                r=dl.fetch(JOB, manifest, [parent_url, origin.url], relay_key=KEY)))
            t.start()
            held = wait_for(lambda: store.get(JOB, 0), 10, "download to start")
            wait_for(lambda: held.held_count() >= len(manifest.chunks) // 3, 30, "a third of the chunks")
            os.kill(parent.pid, signal.SIGKILL)
            t.join(60)
            dl.close()
    finally:
        parent.kill()
        parent.wait()
    r = result["r"]
    assert same_files(r.held.model_dir, tiny_model_dir)
    from_parent, from_origin = r.bytes_from.get(parent_url, 0), r.bytes_from.get(origin.url, 0)
    assert from_parent >= len(manifest.chunks) // 3 * manifest.chunk_size
    assert from_parent + from_origin == manifest.total_size
    # Only the chunks in flight at the kill are fetched again: one retry each, nothing else.
    assert dl.meter.total < manifest.total_size + dl.parallel * manifest.chunk_size
    assert {u for u, _ in reports} == {parent_url}


def test_a_peer_resetting_its_connection_is_one_log_line(tmp_path: Path, tiny_model_dir: Path, caplog,
                                                         capfd) -> None:
    """A child that resets a kept-alive connection while the relay waits for its next request: one log line,
    not the stdlib's traceback on stderr, which broke the worker's one-JSON-object-per-line log."""
    caplog.set_level(logging.INFO, logger="echo2_worker.relay")
    store, _ = fill_store(tmp_path, tiny_model_dir)
    with RelayServer(store) as relay:
        peer = socket.create_connection(("127.0.0.1", relay.port))
        peer.sendall(b"GET /healthz HTTP/1.1\r\nHost: relay\r\n\r\n")
        answer = b""
        while not answer.endswith(b"}"):  # the whole answer: headers and body are two writes
            answer += peer.recv(1024)
        assert answer.startswith(b"HTTP/1.1 200")
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        peer.close()
        wait_for(lambda: any("hung up" in r.getMessage() for r in caplog.records), 30, "the relay's log line")
    assert "Traceback" not in capfd.readouterr().err
