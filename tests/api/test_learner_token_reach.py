"""A job's learner token is a credential of the job's learner: it claims, trains, publishes and reads its own job's
weights. Through the worker routes open to any principal (`api/routes/fleet.py::_visible`, which gives a learner "the
workers on its job") it also reached the routes documented as the worker's, its provider's and admins' only
(`_its_own` now keeps them so)."""

from __future__ import annotations

from tests.factories import (
    activate,
    fake_model_folder,
    new_provider,
    new_user,
    new_worker,
    ok,
    run_tick,
    running_job,
)


def test_a_learner_token_cannot_deregister_a_providers_worker(api, tmp_path):
    """DELETE /v1/workers/{id} is "itself, its provider or an admin": a learner token of the job the worker serves
    deregistered it (its leases released, its token revoked), a provider's machine shut out by another party."""
    _, alice = new_user(api, "alice")
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    _, provider = new_provider(api, "gpu-co")
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}), 201)

    r = learner.delete(f"/v1/workers/{wid}")

    assert r.status_code in (403, 404), f"{r.status_code}: {r.text}"
    assert ok(provider.get(f"/v1/workers/{wid}"))["status"] != "deregistered"
    ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={}))  # the worker's token still works


def test_a_learner_token_reads_no_other_tenants_job_through_a_workers_placement(api, tmp_path):
    """GET /v1/workers/{id}/placement is "visible to the worker itself, its provider and admins"; a user is refused
    it because "its lines name the other jobs it serves or was weighed for". A learner token of Alice's job reads
    the placement of a worker on her job, and with it Bob's job id and what the scheduler said of it."""
    _, alice = new_user(api, "alice")
    _, bob = new_user(api, "bob")
    mine, learner = running_job(api, alice, fake_model_folder(tmp_path / "a"), name="alice-job")
    theirs, _ = running_job(api, bob, fake_model_folder(tmp_path / "b", seed=1), name="bob-secret-job")
    _, provider = new_provider(api, "gpu-co")
    for i in range(2):
        wid, worker = new_worker(api, provider, f"w{i}", price_per_hour=0.1, rollouts_per_s=100.0)
        ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={}))
    _, launched = run_tick(api)  # the tick relaunches the job's learner: its token is the new learner's
    learner = api.client(dict(launched)[mine["id"]]) if mine["id"] in dict(launched) else learner
    on_mine = next(w for w in ok(api.admin.get("/v1/workers"))["items"] if w["job_id"] == mine["id"])
    assert theirs["id"] in str(ok(provider.get(f"/v1/workers/{on_mine['id']}/placement")))  # its provider's to read
    assert alice.get(f"/v1/workers/{on_mine['id']}/placement").status_code == 403  # not the job owner's

    r = learner.get(f"/v1/workers/{on_mine['id']}/placement")

    assert r.status_code in (403, 404) and theirs["id"] not in r.text, f"{r.status_code}: {r.text}"


def test_a_learner_token_reads_no_workers_audits(api, tmp_path):
    """GET /v1/workers/{id}/audits: "visible to the worker itself, its provider and admins" (a user gets a 403);
    a learner token of the job the worker serves reads them (its audits on every job it served)."""
    _, alice = new_user(api, "alice")
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    _, provider = new_provider(api, "gpu-co")
    wid, _ = new_worker(api, provider)
    activate(api, wid, job["id"])
    assert alice.get(f"/v1/workers/{wid}/audits").status_code == 403

    r = learner.get(f"/v1/workers/{wid}/audits")

    assert r.status_code in (403, 404), f"{r.status_code}: {r.text}"
