import pytest

from tests.factories import activate, new_job, new_provider, new_user, new_worker, ok, running_job


def test_provider_signup_needs_admin_unless_open(api):
    assert api.client().post("/v1/providers", json={"name": "p"}).status_code == 401
    _, alice = new_user(api)
    assert alice.post("/v1/providers", json={"name": "p"}).status_code == 403
    mistyped = api.client("e2u_not-a-key").post("/v1/providers", json={"name": "p"})  # not a question of rights
    assert mistyped.status_code == 401 and "unknown or revoked token" in mistyped.text
    provider_id, provider = new_provider(api)
    assert ok(provider.get("/v1/providers/me"))["id"] == provider_id


def test_open_registration_lets_anyone_sign_up(api):
    api.server.settings.open_provider_registration = True
    try:
        body = ok(api.client().post("/v1/providers", json={"name": "volunteer"}), 201)
    finally:
        api.server.settings.open_provider_registration = False
    assert body["token"].startswith("e2p_")


def test_worker_registration_and_visibility(api):
    provider_id, provider = new_provider(api)
    worker_id, worker = new_worker(api, provider, gpu_model="RTX 4090", vram_gb=24, price_per_hour=0.4,
                                   relay_url="http://10.0.0.5:7000/", backends=["vllm", "transformers"])
    got = ok(worker.get(f"/v1/workers/{worker_id}"))
    assert got["provider_id"] == provider_id and got["relay_url"] == "http://10.0.0.5:7000"
    assert got["status"] == "idle" and got["desired"] == "idle"
    assert ok(provider.get("/v1/workers"))["total"] == 1
    assert ok(api.admin.get("/v1/workers"))["total"] == 1
    _, alice = new_user(api)
    assert ok(alice.get("/v1/workers"))["total"] == 0
    assert alice.get(f"/v1/workers/{worker_id}").status_code == 404


def test_a_worker_that_worked_for_a_users_job_stays_visible_to_its_owner_after_moving_on(api, tmp_path):
    """The job's page links to the workers that leased its prompts and those the scheduler weighed for it; once
    such a worker left the job, its owner got a 404 there. The list stays the workers serving the jobs now."""
    from api.models import Worker
    from api.services.fleet import unassign
    from tests.factories import fake_model_folder

    alice_id, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    _, provider = new_provider(api)
    worker_id, worker = new_worker(api, provider)
    activate(api, worker_id, job["id"])
    ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}), 201)
    with api.db.session() as s:  # it moves on: the lease released, the worker idle
        unassign(s, s.get_one(Worker, worker_id))
        s.commit()
    assert ok(alice.get(f"/v1/workers/{worker_id}"))["id"] == worker_id
    assert ok(alice.get("/v1/workers"))["total"] == 0
    _, bob = new_user(api, "bob")
    assert bob.get(f"/v1/workers/{worker_id}").status_code == 404
    assert alice.get(f"/v1/workers/{worker_id}/audits").status_code == 403  # still the worker's and provider's


def test_bad_registration_names_the_field(api):
    _, provider = new_provider(api)
    r = provider.post("/v1/workers", json={"name": "w", "price_per_hour": -1, "backends": []})
    assert r.status_code == 422
    fields = {e["field"] for e in r.json()["errors"]}
    assert {"body.price_per_hour", "body.backends"} <= fields
    # A right-to-left override makes a name display as another in every list (a reviewer's worker did).
    for name in ("gpu\u202e1-rekcah", "a\tb", "w\u2066x"):
        r = provider.post("/v1/workers", json={"name": name, "vram_gb": 16})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "body.name", name
        assert "bidirectional" in r.json()["errors"][0]["reason"]
    assert ok(provider.post("/v1/workers", json={"name": "gpu-1 🚀 <b>", "vram_gb": 16}), 201)  # shown as written


def test_heartbeat_idle_then_active_with_assignment(api, tmp_path):
    from tests.factories import fake_model_folder

    _, provider = new_provider(api)
    worker_id, worker = new_worker(api, provider)
    reply = ok(worker.post(f"/v1/workers/{worker_id}/heartbeat", json={}))
    assert reply["desired"] == "idle" and reply["assignment"] is None
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    activate(api, worker_id, job["id"])
    reply = ok(worker.post(f"/v1/workers/{worker_id}/heartbeat", json={"status": "idle"}))
    assert reply["desired"] == "active"
    a = reply["assignment"]
    assert a["job_id"] == job["id"] and a["version"] == 0 and a["min_version"] == 0
    assert a["relay_parents"] == [api.url]
    [step] = a["fetch"]  # a newcomer fetches version 0, the keyframe
    assert step["version"] == 0 and step["form"] == "full" and step["size"] > 0
    assert step["manifest_url"].endswith(f"/v1/jobs/{job['id']}/versions/0/manifest")
    assert a["sampling"]["group_size"] == 2 and a["lora_rank"] is None
    reply = ok(worker.post(f"/v1/workers/{worker_id}/heartbeat", json={"versions_held": [0]}))
    assert reply["assignment"]["fetch"] == []  # holding it: nothing to fetch


def test_a_worker_moved_to_another_job_fetches_that_jobs_version_not_its_old_ones(api, tmp_path):
    from tests.factories import fake_model_folder

    _, alice = new_user(api)
    old, _ = running_job(api, alice, fake_model_folder(tmp_path / "a"), name="old")
    new, _ = running_job(api, alice, fake_model_folder(tmp_path / "b", seed=1), name="new")
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, new["id"])
    # It still holds version 0 of the job it served before: that is not the new job's version 0.
    reply = ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={"job_id": old["id"], "versions_held": [0]}))
    [step] = reply["assignment"]["fetch"]
    assert step["version"] == 0 and step["manifest_url"].endswith(f"/v1/jobs/{new['id']}/versions/0/manifest")
    r = worker.post("/v1/leases", json={"job_id": new["id"], "max_prompts": 1, "version": 0})
    assert r.status_code == 409 and "has not reported holding version 0" in r.json()["detail"]


def test_a_lora_job_tells_its_workers_the_adapter_rank_from_the_first_version(api, tmp_path):
    from tests.factories import fake_model_folder

    _, provider = new_provider(api)
    worker_id, worker = new_worker(api, provider)
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), lora={"rank": 8})
    activate(api, worker_id, job["id"])
    a = ok(worker.post(f"/v1/workers/{worker_id}/heartbeat", json={}))["assignment"]
    assert a["version"] == 0 and a["lora_rank"] == 8  # version 0 is the base alone; vLLM is built for adapters


def test_relay_key_is_per_job_and_version(api, tmp_path):
    from tests.factories import fake_model_folder, publish

    _, provider = new_provider(api)
    _, alice = new_user(api)
    folder = fake_model_folder(tmp_path / "m")
    (job_a, learner_a), (job_b, _) = running_job(api, alice, folder), running_job(api, alice, folder)
    workers = [new_worker(api, provider, name=f"w{i}") for i in range(3)]
    for (wid, _), job in zip(workers, (job_a, job_a, job_b), strict=True):
        activate(api, wid, job["id"])

    def keys() -> list[str]:
        return [ok(w.post(f"/v1/workers/{wid}/heartbeat", json={}))["assignment"]["relay_key"] for wid, w in workers]

    a1, a2, b = keys()
    assert a1 == a2 != b and len(a1) == 64  # every worker on a version can serve it to the others
    assert keys() == [a1, a2, b]
    publish(learner_a, job_a["id"], folder, version=1, step=0)
    new_a1, new_a2, same_b = keys()
    assert new_a1 == new_a2 != a1 and same_b == b  # a worker that left at version 0 cannot read version 1


def test_assigned_worker_waits_until_a_version_exists(api):
    _, provider = new_provider(api)
    worker_id, worker = new_worker(api, provider)
    _, alice = new_user(api)
    job = new_job(alice)
    activate(api, worker_id, job["id"])
    reply = ok(worker.post(f"/v1/workers/{worker_id}/heartbeat", json={}))
    assert reply["desired"] == "idle" and reply["assignment"] is None


def measure(api, job_id: str, url: str, mbps: float) -> None:
    """A worker of another provider on the job reports downloading 8 MB from `url` at `mbps`."""
    _, provider = new_provider(api, f"measurer-{url}")
    wid, client = new_worker(api, provider, "measurer")
    activate(api, wid, job_id)
    size = 8 * 2**20
    ok(client.post(f"/v1/workers/{wid}/heartbeat",
                   json={"fetched_from": [{"url": url, "bytes": size, "seconds": size * 8 / (mbps * 1e6)}]}))


def relays(api, job_id, claims_and_rates):
    """Relay workers of one provider on the job: {measured rate: (id, client)}; claims are wildly off."""
    _, provider = new_provider(api)
    out = {}
    for i, (claimed, rate) in enumerate(claims_and_rates):
        url = f"http://127.0.0.{i + 2}:7000"
        wid, client = new_worker(api, provider, f"w{i}", upload_mbps=claimed, relay_url=url)
        activate(api, wid, job_id)
        if rate is not None:
            measure(api, job_id, url, rate)
        out[rate] = (wid, client)
    return out


def parents_of(worker):
    wid, client = worker
    return ok(client.post(f"/v1/workers/{wid}/heartbeat", json={}))["assignment"]["relay_parents"]


def test_relay_tree_puts_measured_uplinks_near_the_origin(api, tmp_path):
    from tests.factories import fake_model_folder

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    api.server.settings.relay_fanout = 2
    try:  # the one claiming 1e6 Mbit/s measures slowest; the most modest claim measures fastest
        workers = relays(api, job["id"], [(1e6, 10.0), (10, 1000.0), (500, 500.0), (100, 100.0), (1e6, None)])
        _, provider = new_provider(api, "leaves")
        leaf_id, leaf = new_worker(api, provider, "leaf")
        activate(api, leaf_id, job["id"])
        assert parents_of(workers[1000.0]) == [api.url]
        assert parents_of(workers[500.0]) == ["http://127.0.0.3:7000", api.url]
        assert parents_of(workers[100.0]) == ["http://127.0.0.3:7000", api.url]
        assert parents_of(workers[10.0]) == ["http://127.0.0.4:7000", api.url]
        assert parents_of(workers[None]) == ["http://127.0.0.4:7000", api.url]  # unmeasured: last
        leaf_parents = parents_of((leaf_id, leaf))
        assert len(leaf_parents) == 2 and leaf_parents[-1] == api.url
    finally:
        api.server.settings.relay_fanout = 1


def test_default_relay_is_a_chain_by_measured_uplink_skipping_peers_others_report(api, tmp_path):
    from tests.factories import fake_model_folder

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    workers = relays(api, job["id"], [(100, 100.0), (1000, 1000.0), (500, 500.0)])
    assert parents_of(workers[1000.0]) == [api.url]
    assert parents_of(workers[500.0]) == ["http://127.0.0.3:7000", api.url]
    assert parents_of(workers[100.0]) == ["http://127.0.0.4:7000", api.url]
    bad = {"bad_sources": [{"url": "http://127.0.0.4:7000", "reason": "sha256 mismatch"}]}
    wid, client = workers[100.0]  # its own provider's reports, however many, do not count
    for _ in range(32):
        ok(client.post(f"/v1/workers/{wid}/heartbeat", json=bad))
    _, other = new_provider(api, "other")
    rival_id, rival = new_worker(api, other, "rival")
    activate(api, rival_id, job["id"])
    for _ in range(32):  # nor do 32 from one other provider
        ok(rival.post(f"/v1/workers/{rival_id}/heartbeat", json={"bad_sources": bad["bad_sources"] * 32}))
    assert ok(api.admin.get(f"/v1/workers/{workers[500.0][0]}"))["bad_chunks"] == 1
    assert parents_of(workers[100.0]) == ["http://127.0.0.4:7000", api.url]
    for i in range(api.server.settings.relay_max_bad_chunks - 1):  # distinct providers: evicted
        _, p = new_provider(api, f"reporter-{i}")
        rid, r = new_worker(api, p, "r")
        activate(api, rid, job["id"])
        ok(r.post(f"/v1/workers/{rid}/heartbeat", json=bad))
    assert parents_of(workers[100.0]) == ["http://127.0.0.3:7000", api.url]


def test_bad_source_reports_count_distinct_other_providers(api, tmp_path):
    from tests.factories import fake_model_folder

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    _, provider = new_provider(api)
    liar_id, _ = new_worker(api, provider, "liar", relay_url="http://127.0.0.9:7000")
    activate(api, liar_id, job["id"])
    hb = {"bad_sources": [{"url": "http://127.0.0.9:7000", "reason": "chunk 3 sha256 mismatch"}]}
    sibling_id, sibling = new_worker(api, provider, "sibling")
    activate(api, sibling_id, job["id"])
    ok(sibling.post(f"/v1/workers/{sibling_id}/heartbeat", json=hb))
    assert ok(api.admin.get(f"/v1/workers/{liar_id}"))["bad_chunks"] == 0
    _, other = new_provider(api, "other")
    wid, worker = new_worker(api, other, "honest")
    ok(worker.post(f"/v1/workers/{wid}/heartbeat", json=hb))  # not on the job: it downloaded nothing from it
    assert ok(api.admin.get(f"/v1/workers/{liar_id}"))["bad_chunks"] == 0
    activate(api, wid, job["id"])
    ok(worker.post(f"/v1/workers/{wid}/heartbeat", json=hb))
    ok(worker.post(f"/v1/workers/{wid}/heartbeat", json=hb))
    assert ok(api.admin.get(f"/v1/workers/{liar_id}"))["bad_chunks"] == 1


def test_what_a_worker_says_of_a_relay_counts_only_for_a_download_it_can_have_made(api, tmp_path):
    """A hostile provider's workers: one idle reporting an honest relay slow, then on the job a rate of infinity,
    one of 8.6 Tbit/s and slow ones again, and a decoy off the job at the honest relay's address (to soak up
    reports). The relay keeps the median of what the providers on its job measured: the honest two's."""
    from tests.factories import fake_model_folder

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    relay_id, _ = relays(api, job["id"], [(100, 400.0)])[400.0]  # at http://127.0.0.2:7000
    measure(api, job["id"], "http://127.0.0.2:7000", 400.0)  # a second honest provider measures it the same

    def rate() -> float:
        return ok(api.admin.get(f"/v1/workers/{relay_id}"))["measured_upload_mbps"]

    _, hostile = new_provider(api, "hostile")
    decoy_id, decoy = new_worker(api, hostile, "decoy", relay_url="http://127.0.0.2:7000")  # the same address
    idle_id, idle = new_worker(api, hostile, "idle")

    def say(seconds: float, size: int = 2**20, times: int = 1) -> None:
        beat = {"fetched_from": [{"url": "http://127.0.0.2:7000", "bytes": size, "seconds": seconds}]}
        for _ in range(times):
            ok(idle.post(f"/v1/workers/{idle_id}/heartbeat", json=beat))

    say(86_400, times=25)  # on no job: it downloaded nothing from the relay
    assert rate() == pytest.approx(400.0)
    activate(api, idle_id, job["id"])
    say(5e-324)  # shorter than a millisecond: no measurement (it stored infinity)
    say(0.001, size=2**30)  # 8.6 Tbit/s, counted as 100 Gbit/s: one provider of three
    assert rate() == pytest.approx(400.0)
    say(86_400, times=25)
    assert rate() == pytest.approx(400.0)
    bad = {"bad_sources": [{"url": "http://127.0.0.2:7000", "reason": "chunk 0 sha256 mismatch"}]}
    for i in range(3):
        _, p = new_provider(api, f"peer-{i}")
        rid, r = new_worker(api, p, "peer")
        activate(api, rid, job["id"])
        ok(r.post(f"/v1/workers/{rid}/heartbeat", json=bad))
    assert ok(api.admin.get(f"/v1/workers/{relay_id}"))["bad_chunks"] == 3  # the relay that served them
    assert ok(api.admin.get(f"/v1/workers/{decoy_id}"))["bad_chunks"] == 0


def test_production_relay_urls_must_be_public(api):
    _, provider = new_provider(api)
    api.server.settings.env = "production"
    try:
        for url in ("http://127.0.0.1:7000", "http://10.0.0.5:7000", "http://169.254.1.1:7000",
                    "http://localhost:7000", "http://0.0.0.0:7000", "http://[::1]:7000", "http://192.168.1.2/",
                    # not URLs a peer can reach at all: each was a 500 or a reset connection
                    "http://[::1", "http://.:7000", f"http://{'a' * 64}.example.com", "http://a..b:7000",
                    "http://93.184.216.34:99999", "http://[fe80::1%25eth0]:7000"):
            r = provider.post("/v1/workers", json={"name": "r", "relay_url": url})
            assert r.status_code == 422 and r.json()["errors"][0]["field"] == "relay_url", (url, r.text)
        assert provider.post("/v1/workers", json={"name": "r", "relay_url": "http://93.184.216.34:7000"}).status_code \
            == 201
    finally:
        api.server.settings.env = "dev"


def test_a_lease_needs_the_version_reported_held(api, tmp_path):
    from tests.factories import fake_model_folder, hold

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    hold(worker)  # reports holding nothing
    lease = {"job_id": job["id"], "max_prompts": 1, "version": 0}
    r = worker.post("/v1/leases", json=lease)
    assert r.status_code == 409 and "has not reported holding version 0" in r.json()["detail"]
    hold(worker, 0)
    ok(worker.post("/v1/leases", json=lease), 201)


def test_heartbeat_for_another_worker_is_403(api):
    _, provider = new_provider(api)
    a_id, _ = new_worker(api, provider, "a")
    _, b = new_worker(api, provider, "b")
    assert b.post(f"/v1/workers/{a_id}/heartbeat", json={}).status_code == 403


def test_deregistration_revokes_the_token(api):
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    assert worker.delete(f"/v1/workers/{wid}").status_code == 204
    assert worker.post(f"/v1/workers/{wid}/heartbeat", json={}).status_code == 401
    assert ok(api.admin.get(f"/v1/workers/{wid}"))["status"] == "deregistered"
    assert ok(provider.get("/v1/providers/me"))["num_workers"] == 0


def test_listing_filters_used_by_the_dashboard(api, tmp_path):
    from tests.factories import fake_model_folder

    prov_id, provider = new_provider(api)
    assert [p["id"] for p in ok(api.admin.get("/v1/providers"))] == [prov_id]
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    on_job, _ = new_worker(api, provider, "on")
    idle, _ = new_worker(api, provider, "idle")
    activate(api, on_job, job["id"])
    by_job = ok(api.admin.get("/v1/workers", params={"job_id": job["id"]}))
    assert [w["id"] for w in by_job["items"]] == [on_job]
    by_status = ok(api.admin.get("/v1/workers", params={"status": "idle"}))
    assert {w["id"] for w in by_status["items"]} == {on_job, idle}
    assert ok(alice.get("/v1/workers", params={"job_id": job["id"]}))["total"] == 1
    left, left_worker = new_worker(api, provider, "left")
    assert left_worker.delete(f"/v1/workers/{left}").status_code == 204
    registered = ok(provider.get("/v1/workers", params={"include_deregistered": "false"}))
    assert {w["id"] for w in registered["items"]} == {on_job, idle} and registered["total"] == 2
    assert ok(provider.get("/v1/workers"))["total"] == 3  # deregistered ones included unless asked


def test_heartbeat_checks_the_token_before_the_body(api):
    _, provider = new_provider(api)
    worker_id, worker = new_worker(api, provider)
    anonymous = api.client()
    r = anonymous.post(f"/v1/workers/{worker_id}/heartbeat", json={"status": "dancing"})
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    r = worker.post(f"/v1/workers/{worker_id}/heartbeat", json={"status": "dancing"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "body.status"
    assert api.client("e2w_not-a-token").post(f"/v1/workers/{worker_id}/heartbeat", json={}).status_code == 401
    _, other = new_worker(api, provider, name="other")
    r = other.post(f"/v1/workers/{worker_id}/heartbeat", json={})
    assert r.status_code == 403 and "itself" in r.json()["detail"]


def test_a_provider_reads_why_the_scheduler_left_its_worker_idle(api, tmp_path):
    """A worker too small for the only job stayed "idle", and only the job's owner could read why (its decisions);
    its provider saw nothing, in the API, the dashboard or `echo2-worker status`."""
    from learner.tiny import build_tiny_model
    from tests.factories import run_tick

    _, alice = new_user(api)
    job, _ = running_job(api, alice, build_tiny_model(tmp_path / "tiny"), grpo={"group_size": 2, "prompts_per_step": 2})
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider, "small", vram_gb=0.001, rollouts_per_s=100.0)
    ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={}))
    run_tick(api)
    run_tick(api)  # a decision decided again adds to its line's count, not a second line
    [line] = ok(provider.get(f"/v1/workers/{wid}/placement"))
    assert line["job_id"] == job["id"] and line["action"] == "skipped"
    assert line["line"].startswith(f"skipped {wid}: VRAM 0.001 GiB < need"), line
    assert ok(worker.get(f"/v1/workers/{wid}/placement")) == [line]  # the worker itself
    assert alice.get(f"/v1/workers/{wid}/placement").status_code == 403  # its lines name other tenants' jobs
    _, rival = new_provider(api, "rival")
    assert rival.get(f"/v1/workers/{wid}/placement").status_code == 404
