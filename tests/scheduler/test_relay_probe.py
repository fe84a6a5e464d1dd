"""The control plane confirms bad-source reports itself: a relay serving corrupt chunks is confirmed bad
and evicted even on one report, one serving the right bytes has the reports against it voided."""

from __future__ import annotations

import pytest
from echo2.protocol import Manifest
from echo2.snapshots import iter_stream
from echo2_worker.relay import RelayServer
from echo2_worker.store import VersionStore

from api.models import Job, utcnow
from api.services.fleet import relay_key
from scheduler.relay_probe import probe_reported
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


def report(api, url):
    _, provider = new_provider(api, "reporter-co")
    wid, client = new_worker(api, provider, "reporter")
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
        report(api, liar.url)
        assert ok(api.admin.get(f"/v1/workers/{wid}"))["bad_chunks"] == 1  # below the threshold of 3
        assert probe(api) == 1 and liar.requests >= 1
        got = ok(api.admin.get(f"/v1/workers/{wid}"))
        assert got["relay_confirmed_bad_at"] and got["trust"] == "suspect"
        assert probe(api) == 0  # confirmed: not probed again
    finally:
        liar.close()


def test_a_relay_serving_the_right_bytes_has_its_reports_voided(api, job_and_folder, tmp_path):
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
        report(api, server.url)
        assert probe(api) == 1
        got = ok(api.admin.get(f"/v1/workers/{wid}"))
        assert got["bad_chunks"] == 0 and got["relay_confirmed_bad_at"] is None and got["trust"] == "probation"
    finally:
        server.stop()


def test_an_unreachable_relay_keeps_its_reports(api, job_and_folder):
    job, _ = job_and_folder
    wid = relay_worker(api, job, "http://127.0.0.1:9")
    report(api, "http://127.0.0.1:9")
    assert probe(api) == 1
    got = ok(api.admin.get(f"/v1/workers/{wid}"))
    assert got["bad_chunks"] == 1 and got["relay_confirmed_bad_at"] is None
    assert probe(api) == 0  # probed again only once a new report comes
