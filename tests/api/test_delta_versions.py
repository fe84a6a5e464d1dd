"""Versions published as deltas over HTTP: what the origin accepts, serves and keeps, and what each worker
is told to fetch."""

from __future__ import annotations

import hashlib
import io
import tarfile

import pytest
from echo2.deltas import Folder, apply_delta, file_refs
from echo2.protocol import Manifest

from tests.factories import (
    activate,
    forms,
    new_job,
    new_provider,
    new_user,
    new_worker,
    ok,
    publish_forms,
    running_job,
    start_learner,
    version_folder,
)


@pytest.fixture
def setup(api, tmp_path):
    _, alice = new_user(api)
    job, learner = running_job(api, alice, version_folder(tmp_path, 0), staleness=1, max_steps=50)
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    return job, learner, alice, worker, wid, tmp_path


def fetch_plan(worker, wid, held: list[int]) -> list[tuple[int, str]]:
    reply = ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={"versions_held": held}))
    return [(s["version"], s["form"]) for s in reply["assignment"]["fetch"]]


def test_holders_fetch_deltas_newcomers_the_keyframe_and_the_deltas_after_it(api, setup):
    job, learner, alice, worker, wid, root = setup
    jid = job["id"]
    publish_forms(learner, jid, forms(root, 1, full=False))
    publish_forms(learner, jid, forms(root, 2, full=True))
    read = publish_forms(learner, jid, forms(root, 3, full=False))
    assert read["total_size"] is None and read["delta_base"] == 2 and 0 < read["delta_size"] < 0.2 * (64 * 512 * 4)
    assert fetch_plan(worker, wid, [2]) == [(3, "delta")]
    assert fetch_plan(worker, wid, []) == [(2, "full"), (3, "delta")]
    assert fetch_plan(worker, wid, [1]) == [(2, "delta"), (3, "delta")]  # cheaper than the keyframe
    assert fetch_plan(worker, wid, [3]) == []
    listed = ok(alice.get(f"/v1/jobs/{jid}/versions"))
    assert [(v["version"], v["total_size"] is not None, v["delta_base"]) for v in listed] == [
        (0, True, None), (1, False, 0), (2, True, 1), (3, False, 2)]


def test_a_worker_rebuilds_a_delta_from_the_origin_bit_for_bit(api, setup):
    job, learner, _, worker, wid, root = setup
    jid = job["id"]
    publish_forms(learner, jid, forms(root, 1, full=False))
    manifest = Manifest.model_validate(ok(worker.get(f"/v1/jobs/{jid}/versions/1/delta/manifest")))
    payload = root / "got"
    payload.mkdir()
    data = b"".join(worker.get(f"/v1/jobs/{jid}/versions/1/delta/chunks/{c.index}").content for c in manifest.chunks)
    for f in manifest.files:
        (payload / f.path).write_bytes(data[f.offset:f.offset + f.size])
    base = root / "v0"
    out = apply_delta(manifest, payload, Folder(0, base, file_refs(base)), root / "rebuilt")
    assert (out / "model.safetensors").read_bytes() == (root / "v1" / "model.safetensors").read_bytes()
    r = worker.get(f"/v1/jobs/{jid}/versions/1/manifest")
    assert r.status_code == 404 and "only as a delta" in r.json()["detail"]
    r = worker.get(f"/v1/jobs/{jid}/checkpoint", params={"version": 1})
    assert r.status_code == 404  # a worker may not download checkpoints at all


def test_the_origin_refuses_a_delta_of_the_wrong_base_or_digest_and_a_first_version_without_a_full_form(
        api, setup):
    job, learner, alice, _, _, root = setup
    jid = job["id"]
    publish_forms(learner, jid, forms(root, 1, full=True, delta=False))
    [(_, delta)] = forms(root, 2, full=False)  # made against version 1, the one published last
    assert delta.delta is not None
    wrong = delta.model_copy(update={"delta": delta.delta.model_copy(update={"base_version": 0})})
    r = learner.post(f"/v1/jobs/{jid}/versions", json={"delta": wrong.model_dump(mode="json")})
    assert r.status_code == 422 and "published just before it (1)" in r.json()["detail"]
    lying = delta.model_copy(update={"delta": delta.delta.model_copy(update={"base_digest": "0" * 64})})
    r = learner.post(f"/v1/jobs/{jid}/versions", json={"delta": lying.model_dump(mode="json")})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "delta.delta.base_digest"
    assert ok(alice.get(f"/v1/jobs/{jid}"))["version"] == 1
    fresh_id = new_job(alice)["id"]
    fresh = start_learner(api, fresh_id)
    r = fresh.post(f"/v1/jobs/{fresh_id}/versions", json={"delta": delta.model_dump(mode="json")})
    assert r.status_code == 422 and "first version must be published in full" in r.json()["detail"]


def test_the_checkpoint_of_a_delta_only_version_is_rebuilt_in_full_and_kept(api, setup):
    """It was a 409 naming the keyframes: a job cancelled mid-training kept only its newest version, a delta, and
    its weights could not be had at all (api/services/rebuild.py)."""
    job, learner, alice, _, _, root = setup
    jid = job["id"]
    publish_forms(learner, jid, forms(root, 1, full=False))
    r = alice.get(f"/v1/jobs/{jid}/checkpoint", params={"version": 1})
    assert r.status_code == 200 and r.headers["X-Echo2-Version"] == "1"
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        got = {m.name: hashlib.sha256(tar.extractfile(m).read()).hexdigest() for m in tar.getmembers()}
    wanted = {f.path: hashlib.sha256((root / "v1" / f.path).read_bytes()).hexdigest()
              for f in Manifest.model_validate(ok(alice.get(f"/v1/jobs/{jid}/versions/1/manifest"))).files}
    assert got == wanted and "model.safetensors" in got  # the version itself, byte for byte
    assert 1 in [v["version"] for v in ok(alice.get(f"/v1/jobs/{jid}/versions")) if v["total_size"]]  # kept in full


def test_retention_keeps_the_keyframe_a_newcomer_needs_and_the_deltas_after_it(api, setup):
    job, learner, alice, _, _, root = setup  # S = 1
    jid = job["id"]
    for v in range(1, 5):
        publish_forms(learner, jid, forms(root, v, full=(v == 2)))
        ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json={"step": v - 1, "rollout_ids": [], "t_train_s": 0.1}))
    listed = {v["version"]: v["available"] for v in ok(alice.get(f"/v1/jobs/{jid}/versions"))}
    # step 4, S = 1: versions 3 and 4 are admissible; reaching them takes keyframe 2 and the deltas after it
    assert listed == {0: False, 1: False, 2: True, 3: True, 4: True}


def test_a_job_cancelled_on_a_delta_has_its_newest_version_rebuilt_by_the_sweep_and_the_chain_dropped(api, setup):
    """Retention keeps what a delta-only final version is built from; the sweep rebuilds it in full (no download
    needed) and then lets the chain go: before, every sweep of every process re-collected such a job for nothing."""
    from api.services import retention

    job, learner, alice, _, _, root = setup  # S = 1
    jid = job["id"]
    for v in (1, 2):
        publish_forms(learner, jid, forms(root, v, full=False))
        ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json={"step": v - 1, "rollout_ids": [], "t_train_s": 0.1}))
    ok(alice.post(f"/v1/jobs/{jid}/cancel"))
    kept = {v["version"]: v["available"] for v in ok(alice.get(f"/v1/jobs/{jid}/versions"))}
    assert kept == {0: True, 1: True, 2: True}  # the chain the newest version is built from
    with api.db.session() as s:
        retention.sweep(s, api.server.app.state.blobs, every=0)
    listed = {v["version"]: (v["available"], bool(v["total_size"])) for v in ok(alice.get(f"/v1/jobs/{jid}/versions"))}
    assert listed == {0: (False, True), 1: (False, False), 2: (True, True)}  # rebuilt in full; the rest gone
    r = alice.get(f"/v1/jobs/{jid}/checkpoint")
    assert r.status_code == 200 and r.headers["X-Echo2-Version"] == "2"
