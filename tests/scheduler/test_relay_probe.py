"""The control plane confirms bad-source reports itself: a relay serving corrupt chunks is confirmed bad
and evicted even on one report; right bytes, or none, leave the reports as they are."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from echo2.protocol import Manifest
from echo2.snapshots import iter_stream
from echo2_worker.relay import RelayServer
from echo2_worker.store import VersionStore

from api.models import Job, utcnow
from api.services.fleet import relay_key
from scheduler.relay_probe import DEADLINE_S, probe_reported
from tests.factories import activate, fake_model_folder, new_provider, new_user, new_worker, ok, running_job
from tests.workers.conftest import LyingRelay


@pytest.fixture
def job_and_folder(api, tmp_path):
    _, alice = new_user(api)
    folder = fake_model_folder(tmp_path / "m")
    job, _ = running_job(api, alice, folder)
    return job, folder


def relay_worker(api, job, url):
    _, provider = new_provider(api, f"relay-co-{url}")
    wid, client = new_worker(api, provider, "relay", relay_url=url)
    activate(api, wid, job["id"])
    ok(client.post(f"/v1/workers/{wid}/heartbeat", json={"version_held": 0}))
    return wid


def report(api, job, url, who="reporter-co"):
    _, provider = new_provider(api, who)
    wid, client = new_worker(api, provider, "reporter")
    activate(api, wid, job["id"])
    ok(client.post(f"/v1/workers/{wid}/heartbeat",
                   json={"bad_sources": [{"url": url, "reason": "chunk 0 sha256 mismatch"}]}))


def probe(api):
    with api.db.session() as s:
        n = probe_reported(s, api.server.settings, utcnow())
        s.commit()
    return n


def test_a_relay_serving_corrupt_chunks_is_confirmed_bad_on_one_report(api, job_and_folder):
    job, _ = job_and_folder
    manifest = Manifest.model_validate(ok(api.admin.get(f"/v1/jobs/{job['id']}/versions/0/manifest")))
    liar = LyingRelay(lambda j, v, i: manifest.chunks[i].size if i < len(manifest.chunks) else None)
    try:
        wid = relay_worker(api, job, liar.url)
        report(api, job, liar.url)
        assert ok(api.admin.get(f"/v1/workers/{wid}"))["bad_chunks"] == 1  # below the threshold of 3
        assert probe(api) == 1 and liar.requests >= 1
        got = ok(api.admin.get(f"/v1/workers/{wid}"))
        assert got["relay_confirmed_bad_at"] and got["trust"] == "suspect"
        assert probe(api) == 0  # confirmed: not probed again
    finally:
        liar.close()


def test_right_bytes_to_the_probe_void_no_report(api, job_and_folder, tmp_path):
    """A relay may serve the probe (whose address it can tell) the right bytes and peers garbage: a good probe
    strikes nobody and leaves the reports standing, so those of distinct providers add up to its eviction."""
    job, folder = job_and_folder
    manifest = Manifest.model_validate(ok(api.admin.get(f"/v1/jobs/{job['id']}/versions/0/manifest")))
    with api.db.session() as s:
        key = relay_key(s.get_one(Job, job["id"]), 0)
    store = VersionStore(tmp_path / "store")
    held = store.open(job["id"], manifest, key)
    for i, data in enumerate(iter_stream(folder, manifest.files, manifest.chunk_size)):
        held.put(i, data)
    held.assemble()
    server = RelayServer(store, host="127.0.0.1", port=0)
    server.start()
    try:
        wid = relay_worker(api, job, server.url)
        for n, who in enumerate(("reporter-a", "reporter-b", "reporter-c"), 1):
            report(api, job, server.url, who)
            assert probe(api) == 1 and server.served_chunks >= n
            got = ok(api.admin.get(f"/v1/workers/{wid}"))
            assert got["bad_chunks"] == n and got["relay_confirmed_bad_at"] is None and got["trust"] == "probation"
        assert n >= api.server.settings.relay_max_bad_chunks  # reported by as many providers as evict a relay
    finally:
        server.stop()


def test_a_relay_that_drips_its_bytes_holds_neither_the_probe_nor_the_database(api, job_and_folder):
    """A relay answering a byte every half second, without end: the probe gives up at its deadline, and while it
    waits the database takes other writes (on SQLite a tick's open transaction would hold its write lock)."""
    job, _ = job_and_folder
    dripper = LyingRelay(lambda j, v, i: 1, drip_s=0.5)
    _, provider = new_provider(api, "bystander-co")
    bystander, client = new_worker(api, provider, "bystander")
    try:
        wid = relay_worker(api, job, dripper.url)
        report(api, job, dripper.url)
        with ThreadPoolExecutor(1) as pool:
            start = time.monotonic()
            probing = pool.submit(probe, api)
            while dripper.requests == 0 and time.monotonic() - start < 10:
                time.sleep(0.05)
            beat = time.monotonic()
            ok(client.post(f"/v1/workers/{bystander}/heartbeat", json={"status": "idle"}))
            assert time.monotonic() - beat < DEADLINE_S / 2
            assert probing.result(timeout=30) == 1
        assert time.monotonic() - start < DEADLINE_S + 5
        got = ok(api.admin.get(f"/v1/workers/{wid}"))
        assert got["bad_chunks"] == 1 and got["relay_confirmed_bad_at"] is None  # silence proves nothing
    finally:
        dripper.close()


def test_an_unreachable_relay_keeps_its_reports(api, job_and_folder):
    job, _ = job_and_folder
    wid = relay_worker(api, job, "http://127.0.0.1:9")
    report(api, job, "http://127.0.0.1:9")
    assert probe(api) == 1
    got = ok(api.admin.get(f"/v1/workers/{wid}"))
    assert got["bad_chunks"] == 1 and got["relay_confirmed_bad_at"] is None
    assert probe(api) == 0  # probed again only once a new report comes
