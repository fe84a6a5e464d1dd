"""The reconcile tick against a real control plane database: liveness, lease expiry, the cost ledger,
budgets, learner launches (with fencing tokens) and cost-aware activation with recorded decisions."""

import threading
from datetime import timedelta

import pytest
from sqlalchemy import event, select

from api.models import Decision, Job, LedgerEntry, SchedulerState, Worker, utcnow
from scheduler import billing
from tests.factories import (
    activate,
    bill_past_budget,
    drive_job,
    fake_model_folder,
    hold,
    job_spec,
    learner_for,
    new_job,
    new_provider,
    new_user,
    new_worker,
    ok,
    run_tick,
    running_job,
    step_report,
    submit_group,
)


def test_queued_job_gets_a_learner_launched_once_with_a_working_token(api):
    _, alice = new_user(api)
    job = new_job(alice)
    report, launched = run_tick(api)
    assert [j for j, _ in launched] == [job["id"]]
    token = launched[0][1]
    assert api.client(token).post(f"/v1/jobs/{job['id']}/learner/start").status_code == 200
    _, again = run_tick(api)
    assert again == []


def test_silent_learner_is_relaunched_and_the_old_token_fenced(api, tmp_path):
    _, alice = new_user(api)
    job, old_learner = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    with api.db.session() as s:
        j = s.get(Job, job["id"])
        j.learner_launched_at = j.learner_heartbeat_at = utcnow() - timedelta(minutes=10)
        s.commit()
    _, launched = run_tick(api)
    assert [j for j, _ in launched] == [job["id"]]
    assert old_learner.post(f"/v1/jobs/{job['id']}/learner/heartbeat", json={"step": 0}).status_code == 401


def test_silent_worker_goes_offline_and_its_lease_returns(api, tmp_path):
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider, price_per_hour=1.0)
    ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={}))
    run_tick(api)  # activation: the only worker
    assert ok(api.admin.get(f"/v1/workers/{wid}"))["job_id"] == job["id"]
    hold(worker, 0)  # fetched version 0
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 3, "version": 0}), 201)
    later = utcnow() + timedelta(seconds=api.server.settings.worker_offline_after_s + 1)
    report, _ = run_tick(api, now=later)
    assert report.offline == 1
    got = ok(api.admin.get(f"/v1/workers/{wid}"))
    assert got["status"] == "offline" and got["job_id"] is None
    prompts = ok(alice.get(f"/v1/jobs/{job['id']}/prompts", params={"limit": 200}))["items"]
    leased = {p["prompt_id"] for p in lease["prompts"]}
    assert all(p["state"] == "available" for p in prompts if p["id"] in leased)


def test_activation_prefers_the_cheapest_sufficient_workers_and_explains(api, tmp_path):
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), grpo={"group_size": 2, "prompts_per_step": 2})
    _, provider = new_provider(api)
    ids = {}
    # Unmeasured, each counts for at most trial_share (1/4) of the need, whatever it claims: four are needed.
    for name, price in (*((f"cheap{i}", 0.1) for i in range(5)), ("pricey", 9.0)):
        wid, w = new_worker(api, provider, name, price_per_hour=price, rollouts_per_s=100.0)
        ok(w.post(f"/v1/workers/{wid}/heartbeat", json={}))
        ids[name] = wid
    report, _ = run_tick(api)
    assert report.activated == 4
    assert sum(ok(api.admin.get(f"/v1/workers/{ids[f'cheap{i}']}"))["desired"] == "active" for i in range(5)) == 4
    assert ok(api.admin.get(f"/v1/workers/{ids['pricey']}"))["desired"] == "idle"
    lines = ok(alice.get(f"/v1/jobs/{job['id']}/decisions"))
    activated = {d["worker_id"] for d in lines if d["action"] == "activated"}
    assert len(activated) == 4 and activated <= {ids[f"cheap{i}"] for i in range(5)}
    assert all(d["line"] for d in lines)


def test_decisions_are_stored_as_changes(api, tmp_path):
    """Re-solves that decide the same for a worker add to its newest line's run instead of a row each; a
    changed decision is a new row."""
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), grpo={"group_size": 2, "prompts_per_step": 2})
    _, provider = new_provider(api)
    for i in range(5):
        wid, w = new_worker(api, provider, f"w{i}", price_per_hour=0.1 + i, rollouts_per_s=100.0)
        ok(w.post(f"/v1/workers/{wid}/heartbeat", json={}))
        run_tick(api)  # each joins: a re-solve, which keeps the workers already chosen
    with api.db.session() as db:
        rows = db.scalars(select(Decision).where(Decision.job_id == job["id"])).all()
    pairs = [(d.worker_id, d.action) for d in rows]
    assert len(pairs) == len(set(pairs)) < 5 * 4  # a row per worker per change, not per worker per re-solve
    kept = [d for d in rows if d.action == "kept"]
    longest = max(kept, key=lambda d: d.repeats)  # the first worker chosen, kept at every later re-solve
    assert longest.repeats >= 2 and longest.decided_at > longest.created_at
    lines = ok(alice.get(f"/v1/jobs/{job['id']}/decisions"))
    assert {d["repeats"] for d in lines} >= {1, longest.repeats}


def test_a_job_whose_budget_runs_out_pauses_and_resumes_when_it_is_raised(api, tmp_path):
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), budget_usd=0.5,
                         learner={"price_per_hour": 3600.0})
    bill_past_budget(api, job["id"])
    learner = learner_for(api, job["id"])  # the learner at work when the budget ran out
    got = ok(alice.get(f"/v1/jobs/{job['id']}"))
    assert got["status"] == "paused" and got["paused_for"] == "budget", got
    assert "budget of $0.50 exhausted" in got["status_reason"] and "raise budget_usd" in got["status_reason"]
    assert f"echo2 jobs budget {job['id']} USD (PATCH /v1/jobs/{job['id']})" in got["status_reason"]
    assert got["cost"]["learner_usd"] >= 0.5
    beat = ok(learner.post(f"/v1/jobs/{job['id']}/learner/heartbeat", json={"step": 0, "busy_s": 0, "wall_s": 1}))
    assert beat["stop"] and beat["job_status"] == "paused"  # the learner stops, the job does not end
    claim = ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 0, "max_groups": 4}))
    assert claim["groups"] == []
    _, launched = run_tick(api)
    assert launched == [] and ok(alice.get(f"/v1/jobs/{job['id']}"))["status"] == "paused"

    spent = got["cost"]["total_usd"]
    still = ok(alice.patch(f"/v1/jobs/{job['id']}", json={"budget_usd": spent / 2}))
    assert still["status"] == "paused" and "exhausted" in still["status_reason"]
    raised = ok(alice.patch(f"/v1/jobs/{job['id']}", json={"budget_usd": spent + 100}))
    assert raised["status"] == "queued" and raised["spec"]["budget_usd"] == spent + 100
    _, launched = run_tick(api)
    assert [j for j, _ in launched] == [job["id"]]  # a new learner, which resumes from the checkpoint
    new_learner = api.client(launched[0][1])
    assert ok(new_learner.post(f"/v1/jobs/{job['id']}/learner/start"))["job"]["status"] == "running"
    assert learner.post(f"/v1/jobs/{job['id']}/learner/heartbeat",
                        json={"step": 0, "busy_s": 0, "wall_s": 1}).status_code == 401  # fenced off


def test_a_budget_update_is_checked_and_refused_for_a_finished_job(api, tmp_path):
    _, alice = new_user(api)
    job = new_job(alice)
    r = alice.patch(f"/v1/jobs/{job['id']}", json={"budget_usd": -1})
    assert r.status_code == 422 and "budget_usd" in r.text
    assert alice.patch(f"/v1/jobs/{job['id']}", json={}).status_code == 422
    ok(alice.post(f"/v1/jobs/{job['id']}/cancel"))
    r = alice.patch(f"/v1/jobs/{job['id']}", json={"budget_usd": 5})
    assert r.status_code == 409 and "finished" in r.json()["detail"]


def test_workers_are_paid_for_trained_rollouts_named_in_the_ledger(api, tmp_path):
    _, alice = new_user(api)
    job = new_job(alice)
    driven = drive_job(api, job["id"], fake_model_folder(tmp_path / "m"))
    _, provider = new_provider(api, "idle-co")
    idle_id, idle = new_worker(api, provider, "idle", price_per_hour=3600.0, rollouts_per_s=1e6)
    now = utcnow()
    with api.db.session() as s:
        for wid in (driven.worker_id, idle_id):
            w = s.get(Worker, wid)
            w.status, w.job_id, w.desired, w.price_per_hour, w.activated_mu = "active", job["id"], "active", 3600.0, 1.0
        s.get(Job, job["id"]).learner_heartbeat_at = now
        s.commit()
    run_tick(api, now=now)
    run_tick(api, now=now + timedelta(seconds=2))
    with api.db.session() as s:
        entries = s.scalars(select(LedgerEntry).where(LedgerEntry.kind == "worker")).all()
        paid, idle_row = s.get(Worker, driven.worker_id), s.get(Worker, idle_id)
        assert [e.worker_id for e in entries] == [driven.worker_id]
        assert sorted(entries[0].rollout_ids) == sorted(driven.rollout_ids)
        # two trained groups at f = 0.5 of the activated 1 group/s buy 4 s, capped by the 2 s it was active
        assert entries[0].seconds == pytest.approx(2.0) and entries[0].amount_usd == pytest.approx(2.0)
        assert paid.earned_usd == pytest.approx(2.0) and idle_row.earned_usd == 0.0
    assert ok(alice.get(f"/v1/jobs/{job['id']}"))["cost"]["workers_usd"] == pytest.approx(2.0)


def test_dissemination_time_is_measured_by_the_control_plane_not_reported(api, tmp_path):
    from scheduler.reconcile import _t_bcast
    from tests.factories import activate, publish, start_learner

    _, alice = new_user(api)
    job = new_job(alice)
    learner = start_learner(api, job["id"])
    _, provider = new_provider(api)
    claims = {"status": "active", "job_id": job["id"], "stats": {"last_download_s": 999.0}}
    (held_id, held), (silent_id, silent) = [new_worker(api, provider, name) for name in ("held", "silent")]
    for wid, w in ((held_id, held), (silent_id, silent)):
        activate(api, wid, job["id"])
        ok(w.post(f"/v1/workers/{wid}/heartbeat", json=claims))
    publish(learner, job["id"], fake_model_folder(tmp_path / "m"), version=0, step=0)
    ok(held.post(f"/v1/workers/{held_id}/heartbeat", json={**claims, "version_held": 0}))
    with api.db.session() as s:
        measured = _t_bcast(s, s.get_one(Worker, held_id))
        reported = _t_bcast(s, s.get_one(Worker, silent_id))
    assert 0 <= measured < 30  # announcement to its heartbeat, not the 999 s it claims
    assert reported == 999.0  # nothing measured yet: its own figure


def test_a_learner_crashing_at_the_same_step_fails_the_job_with_its_error(api, tmp_path):
    _, alice = new_user(api)
    job = new_job(alice)
    _, launched = run_tick(api)
    for attempt in range(api.server.settings.learner_max_failures):
        learner = api.client(launched[-1][1])
        ok(learner.post(f"/v1/jobs/{job['id']}/learner/start"))
        ok(learner.post(f"/v1/jobs/{job['id']}/learner/heartbeat",
                        json={"step": 0, "state": "failed", "error": "RuntimeError: loss is inf"}))
        _, launched = run_tick(api)  # relaunched at once: it reported its own death
        if attempt < api.server.settings.learner_max_failures - 1:
            assert [j for j, _ in launched] == [job["id"]]
    got = ok(alice.get(f"/v1/jobs/{job['id']}"))
    assert got["status"] == "failed" and "failed 3 times in a row at step 0: RuntimeError: loss is inf" in \
        got["status_reason"]
    assert launched == []


def test_a_learner_that_makes_progress_between_crashes_is_relaunched(api, tmp_path):
    _, alice = new_user(api)
    job = new_job(alice)
    driven = drive_job(api, job["id"], fake_model_folder(tmp_path / "m"))  # committed step 0
    for _ in range(api.server.settings.learner_max_failures + 1):
        ok(driven.learner.post(f"/v1/jobs/{job['id']}/learner/heartbeat", json={"step": 1, "error": "killed"}))
        _, launched = run_tick(api)
        assert [j for j, _ in launched] == [job["id"]]
        driven.learner = api.client(launched[0][1])
        with api.db.session() as s:  # as if each relaunch committed a step before it crashed
            s.get(Job, job["id"]).step += 1
            s.commit()
    assert ok(alice.get(f"/v1/jobs/{job['id']}"))["status"] == "running"


def test_a_dead_learner_is_not_billed(api, tmp_path):
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), learner={"price_per_hour": 3600.0})
    now = utcnow()
    with api.db.session() as s:
        s.get(Job, job["id"]).learner_heartbeat_at = now - timedelta(hours=1)
        s.commit()
    run_tick(api, now=now)
    run_tick(api, now=now + timedelta(seconds=2))
    assert ok(alice.get(f"/v1/jobs/{job['id']}"))["cost"]["learner_usd"] == 0.0


def test_a_slow_worker_is_measured_not_failed_and_one_that_never_delivers_is(api, tmp_path):
    from api.models import Rollout
    from scheduler.reconcile import _worker_profile
    from tests.factories import activate, submit_group

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    _, provider = new_provider(api)
    (slow_id, slow), (idle_id, _) = [new_worker(api, provider, name) for name in ("slow", "idle")]
    for wid in (slow_id, idle_id):
        activate(api, wid, job["id"])
    lease = ok(slow.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}), 201)
    ok(submit_group(slow, lease, lease["prompts"][0], 0))
    now = utcnow()
    with api.db.session() as s:
        for wid in (slow_id, idle_id):  # both active for 200 s; the slow one delivered once, 150 s ago
            s.get_one(Worker, wid).active_since = now - timedelta(seconds=200)
        s.scalars(select(Rollout).where(Rollout.worker_id == slow_id)).one().created_at = now - timedelta(seconds=150)
        s.commit()
        slow_row, idle_row = s.get_one(Worker, slow_id), s.get_one(Worker, idle_id)
        measured = _worker_profile(s, slow_row, now, [], api.server.settings)
        failed = _worker_profile(s, idle_row, now, [], api.server.settings)
        assert slow_row.trial_failed_at is None and measured.mu == pytest.approx(1 / 200)
        assert idle_row.trial_failed_at == now and failed.mu == 0.0  # grace 120 s, nothing delivered


def test_a_worker_whose_groups_wait_for_their_audit_does_not_fail_its_trial(api, tmp_path):
    """On probation, a worker with 8 groups waiting for the learner's audit may lease nothing (on any job) until
    they are judged. Moved to another job meanwhile, it delivered nothing there and its trial failed: no
    activation for ten grace periods (20 minutes), though its speed was never in question."""
    from api.models import Rollout
    from scheduler.reconcile import _worker_profile
    from tests.factories import activate, submit_group

    _, alice = new_user(api)
    first, _ = running_job(api, alice, fake_model_folder(tmp_path / "a"), name="first")
    second, _ = running_job(api, alice, fake_model_folder(tmp_path / "b"), name="second")
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, first["id"])
    lease = ok(worker.post("/v1/leases", json={"job_id": first["id"], "max_prompts": 8, "version": 0}), 201)
    for prompt in lease["prompts"]:
        ok(submit_group(worker, lease, prompt, 0))
    activate(api, wid, second["id"])
    refused = worker.post("/v1/leases", json={"job_id": second["id"], "max_prompts": 1, "version": 0})
    assert refused.status_code == 409 and "wait for the learner's audit" in refused.text
    with api.db.session() as s:  # its groups sent 300 s ago; on the second job for 200 s (grace: 120 s)
        for group in s.scalars(select(Rollout).where(Rollout.worker_id == wid)):
            group.created_at = utcnow() - timedelta(seconds=300)
        row = s.get_one(Worker, wid)
        row.active_since = utcnow() - timedelta(seconds=200)
        s.commit()
        _worker_profile(s, row, utcnow(), [], api.server.settings)
        assert row.trial_failed_at is None


def test_a_deactivation_is_explained_on_the_job_the_worker_left(api, tmp_path):
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), grpo={"group_size": 2, "prompts_per_step": 2})
    _, provider = new_provider(api)
    wid, w = new_worker(api, provider, "claimer", rollouts_per_s=100.0)
    ok(w.post(f"/v1/workers/{wid}/heartbeat", json={}))
    assert run_tick(api)[0].activated == 1
    with api.db.session() as s:  # active for longer than the grace time, and nothing delivered
        s.get_one(Worker, wid).active_since = utcnow() - timedelta(seconds=300)
        s.commit()
    ok(w.post(f"/v1/workers/{wid}/heartbeat", json={"status": "active"}))
    assert run_tick(api)[0].deactivated == 1
    lines = ok(alice.get(f"/v1/jobs/{job['id']}/decisions"))
    assert [d["line"] for d in lines if d["action"] == "deactivated"] == [
        f"deactivated {wid}: no longer qualifies: no measured throughput"]


def test_a_worker_below_the_jobs_memory_need_is_never_activated_and_the_job_says_why(api, tmp_path):
    from learner.tiny import build_tiny_model

    _, alice = new_user(api)
    job, _ = running_job(api, alice, build_tiny_model(tmp_path / "tiny"), grpo={"group_size": 2, "prompts_per_step": 2})
    need = ok(alice.get(f"/v1/jobs/{job['id']}"))["memory_need_gb"]
    assert 0.5 < need < 0.6  # the tiny model's weights and one group's KV cache, plus the runtime
    _, provider = new_provider(api)
    small, small_client = new_worker(api, provider, "small", vram_gb=0.25, price_per_hour=0.01, rollouts_per_s=100.0)
    big, big_client = new_worker(api, provider, "big", vram_gb=16, price_per_hour=1.0, rollouts_per_s=100.0)
    for wid, client in ((small, small_client), (big, big_client)):
        ok(client.post(f"/v1/workers/{wid}/heartbeat", json={}))
    for _ in range(3):
        run_tick(api)
    assert ok(api.admin.get(f"/v1/workers/{small}"))["desired"] == "idle"  # the cheapest, but too small
    assert ok(api.admin.get(f"/v1/workers/{big}"))["desired"] == "active"
    lines = [d["line"] for d in ok(alice.get(f"/v1/jobs/{job['id']}/decisions")) if d["worker_id"] == small]
    assert lines and all(line.startswith(f"skipped {small}: VRAM 0.25 GiB < need {need:g} GiB") for line in lines)
    with api.db.session() as s:
        assert not s.scalars(select(Decision).where(Decision.worker_id == small, Decision.action == "activated")).all()


def test_a_running_job_no_worker_serves_says_so_until_one_does(api, tmp_path):
    """With no worker online, or none that can serve it, a running job said nothing (status_reason null) while its
    learner waited, billed."""
    from learner.tiny import build_tiny_model

    _, alice = new_user(api)
    job, _ = running_job(api, alice, build_tiny_model(tmp_path / "tiny"), grpo={"group_size": 2, "prompts_per_step": 2})

    def reason() -> str | None:
        return ok(alice.get(f"/v1/jobs/{job['id']}"))["status_reason"]

    run_tick(api)
    assert reason() == (f"waiting for workers: no worker is online (echo2 jobs explain {job['id']} says why); its "
                        "learner waits for their groups, and is billed meanwhile")
    _, provider = new_provider(api)
    small, small_client = new_worker(api, provider, "small", vram_gb=0.25, rollouts_per_s=100.0)
    ok(small_client.post(f"/v1/workers/{small}/heartbeat", json={}))
    run_tick(api)
    assert reason().startswith("waiting for workers: the one worker online does not serve it now")
    big, big_client = new_worker(api, provider, "big", vram_gb=16, rollouts_per_s=100.0)
    ok(big_client.post(f"/v1/workers/{big}/heartbeat", json={}))
    run_tick(api)
    assert ok(api.admin.get(f"/v1/workers/{big}"))["desired"] == "active" and reason() is None


def test_a_job_can_state_its_memory_need_and_backends(api, tmp_path):
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), workers={"memory_gb": 40, "backends": ["vllm"]})
    assert ok(alice.get(f"/v1/jobs/{job['id']}"))["memory_need_gb"] == 40
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider, "h100", vram_gb=80, rollouts_per_s=100.0)  # transformers only
    ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={}))
    run_tick(api)
    [line] = [d["line"] for d in ok(alice.get(f"/v1/jobs/{job['id']}/decisions")) if d["worker_id"] == wid]
    assert line == f"skipped {wid}: backend transformers not supported (job needs vllm)"
    r = alice.post("/v1/jobs", json=job_spec(workers={"memory_gb": 0}))
    assert r.status_code == 422 and "workers.memory_gb" in r.text
    assert alice.post("/v1/jobs", json=job_spec(workers={"gpu": "a100"})).status_code == 422


def idle_tinker_model(api, tmp_path, user=None) -> str:
    """A Tinker model of `user` (a new one by default) whose sampler checkpoint is version 1 of its fleet job,
    that nobody samples (demand 0) and that no worker serves: the fleet job's id."""
    import httpx

    from tests.factories import publish
    from tests.tinker.test_routes import claim, key_of, ready_model, report, sdk

    user = user or new_user(api, "tinkerer")[1]
    client = sdk(api, key_of(user))
    _, model_id = ready_model(api, client)
    ok(client.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id, "sampling_session_seq_id": 1}))
    work = claim(api, holding=[model_id])["work"]
    order = work["publish"]
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {order['token']}"}) as learner:
        publish(learner, order["job_id"], fake_model_folder(tmp_path / "v0"), version=0, step=0)
        publish(learner, order["job_id"], fake_model_folder(tmp_path / "v1", seed=1), version=1, step=1)
    report(api, work, step=1, published=1)
    return order["job_id"]


def test_an_idle_tinker_model_does_not_hold_up_an_ordinary_job(api, tmp_path):
    fleet_job = idle_tinker_model(api, tmp_path)
    _, alice = new_user(api)
    job = new_job(alice)
    _, launched = run_tick(api)  # the fleet job alone is planned: it needs nothing and nothing qualifies
    assert [j for j, _ in launched] == [job["id"]]
    learner = api.client(launched[0][1])
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/start"))
    from tests.factories import publish
    publish(learner, job["id"], fake_model_folder(tmp_path / "m"), version=0, step=0)
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider, price_per_hour=1.0)
    ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={}))
    report, _ = run_tick(api)
    assert report.activated == 1 and ok(api.admin.get(f"/v1/workers/{wid}"))["job_id"] == job["id"]
    fleet = ok(api.admin.get(f"/v1/jobs/{fleet_job}"))
    assert fleet["status"] == "running" and fleet["status_reason"] is None


def test_a_job_the_scheduler_cannot_handle_is_recorded_on_it_and_the_others_go_on(api, tmp_path):
    _, alice = new_user(api)
    run_tick(api)  # not the first tick: billing reads the spec of every job whose learner is alive (it raised)
    broken, _ = running_job(api, alice, fake_model_folder(tmp_path / "b"), name="broken")
    with api.db.session() as s:  # a spec no longer valid (written by an older release, or by hand)
        s.get_one(Job, broken["id"]).spec = {**broken["spec"], "staleness": -1}
        s.commit()
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider, price_per_hour=1.0)
    ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={}))
    report, _ = run_tick(api)
    assert report.activated == 1 and ok(api.admin.get(f"/v1/workers/{wid}"))["job_id"] == job["id"]
    with api.db.session() as s:
        reason = s.get_one(Job, broken["id"]).status_reason
    assert reason.startswith("the scheduler could not check its budget and finish this job: ValidationError")
    assert "staleness" in reason and "retried every tick" in reason
    with api.db.session() as s:  # mended: the next tick plans it and the reason goes
        s.get_one(Job, broken["id"]).spec = broken["spec"]
        s.commit()
    run_tick(api)
    assert ok(alice.get(f"/v1/jobs/{broken['id']}"))["status_reason"] is None


def test_the_tick_report_the_scheduler_logs_names_launched_jobs_without_their_tokens(api):
    _, alice = new_user(api)
    job = new_job(alice)
    report, launched = run_tick(api)
    token = launched[0][1]
    assert job["id"] in str(report) and token not in str(report) and token not in repr(report)


def test_generation_time_is_measured_by_the_control_plane_where_a_worker_says_it_is_faster(api, tmp_path):
    """T_gen decides whether a worker is fresh enough for a job: one that says it makes a group in 10 ms,
    while its leases take 45 s a group, is taken at 45 s and does not qualify where groups must arrive within
    20 s; one that says it is slower than measured is taken at its word (it can only hurt itself)."""
    from api.models import Lease, Rollout
    from planner.capacity import JobProfile, qualify
    from scheduler.reconcile import _worker_profile
    from tests.factories import activate, group_body

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    _, provider = new_provider(api)
    workers = {name: new_worker(api, provider, name) for name in ("boaster", "modest")}
    claims = {"boaster": 0.01, "modest": 80.0}
    for name, (wid, client) in workers.items():
        activate(api, wid, job["id"])
        lease = ok(client.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 2, "version": 0}), 201)
        bodies = [{**group_body(p, 0), "gen_seconds": claims[name]} for p in lease["prompts"]]
        ok(client.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": bodies}))
    now = utcnow()
    with api.db.session() as s:
        for wid, _ in workers.values():  # each lease granted 100 s ago, answered 10 s ago: 45 s a group
            s.get_one(Worker, wid).active_since = now - timedelta(seconds=200)
            s.scalars(select(Lease).where(Lease.worker_id == wid)).one().created_at = now - timedelta(seconds=100)
            for rollout in s.scalars(select(Rollout).where(Rollout.worker_id == wid)):
                rollout.created_at = now - timedelta(seconds=10)
        s.commit()
        profiles = {name: _worker_profile(s, s.get_one(Worker, wid), now, [], api.server.settings)
                    for name, (wid, _) in workers.items()}
    assert profiles["boaster"].t_gen_s == pytest.approx(45.0)
    assert profiles["modest"].t_gen_s == pytest.approx(80.0)
    fresh_within_20s = JobProfile(job_id=job["id"], rollouts_per_step=8, t_train_s=10.0, staleness=2,
                                  publish_period=1)
    verdict = qualify(profiles["boaster"], fresh_within_20s)
    assert not verdict.ok and "T_bcast+T_gen" in verdict.reason


def test_groups_sent_on_a_released_lease_are_not_counted_as_delivered(api, tmp_path):
    """μ counts the groups a worker delivered that the job could use. One that leases, releases and answers the
    released lease (its groups refused as late, no strike) was measured at whatever rate it answered, and
    outbid honest workers for the job while delivering nothing."""
    from scheduler.reconcile import _delivered
    from tests.factories import activate, group_body

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    _, provider = new_provider(api)
    wid, client = new_worker(api, provider)
    activate(api, wid, job["id"])
    for _ in range(3):
        lease = ok(client.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 2, "version": 0}), 201)
        ok(client.post(f"/v1/leases/{lease['id']}/release"))
        answers = ok(client.post(f"/v1/leases/{lease['id']}/rollouts",
                                 json={"groups": [group_body(p, 0) for p in lease["prompts"]]}))["results"]
        assert {a["reason"] for a in answers} == {"lease is released"}
    with api.db.session() as s:
        assert _delivered(s, wid, utcnow() - timedelta(seconds=60))[0] == 0  # it was 6


def test_two_ticks_at_once_take_turns_and_bill_no_interval_twice(api, tmp_path):
    """The Redis lock keeps ticks apart only for its 120 s: a longer tick let the next read the same last tick and
    bill the learner's interval since then a second time. A tick reads its last tick under a row lock held to its
    commit: the second waits for the first and bills from where it ended."""
    if not api.db.is_postgres:
        pytest.skip("SQLite's one writer runs one tick at a time anyway")
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), learner={"price_per_hour": 3600.0})
    t0 = utcnow()
    with api.db.session() as s:
        s.get_one(Job, job["id"]).learner_heartbeat_at = t0
        s.commit()
    run_tick(api, now=t0)
    first = api.db.session().__enter__()  # a long tick at t0 + 10 s: it holds the last tick's row until it commits
    row = first.get(SchedulerState, "last_tick", with_for_update=True)
    row.value = {"at": (t0 + timedelta(seconds=10)).timestamp()}
    first.flush()
    second = threading.Thread(target=run_tick, args=(api,), kwargs={"now": t0 + timedelta(seconds=12)})
    second.start()
    second.join(2)
    assert second.is_alive()  # it waits for the first
    first.commit()
    first.close()
    second.join(30)
    with api.db.session() as s:
        billed = [e.seconds for e in s.scalars(select(LedgerEntry).where(LedgerEntry.job_id == job["id"],
                                                                         LedgerEntry.kind == "learner"))]
    assert billed == [pytest.approx(2.0)]  # from the first's end, not from t0 (12 s, 10 of them the first's)


def test_a_worker_delivering_at_its_rate_is_paid_all_its_active_time_when_the_learner_trains_after_pay_window(
        api, tmp_path):
    """A worker activated at 0.02 groups/s ($3600/h) delivers 8 groups in 6 minutes on a job whose learner takes a
    6-minute step (a large model; or the worker is slow and its lease of 8 takes that long): 0.022 groups/s, better
    than the rate it was activated for, so it is to be paid in full (each group buys 1 / (f * mu_a) = 100 s, 800 s
    in all, for 360 s of active time). The groups are trained, and paid, at the step's end: the tick paid 300 s, not
    360 (review finding): `bill` capped the time waiting to be paid at `pay_window_s` (300 s), dropping time the
    groups delivered during it pay for because the learner trained them later than that. The window now reaches past
    what the worker's waiting groups pay for."""
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"),
                               grpo={"group_size": 2, "prompts_per_step": 8})
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider, "gpu", price_per_hour=3600.0, rollouts_per_s=0.02)
    activate(api, wid, job["id"])
    with api.db.session() as s:
        w = s.get_one(Worker, wid)
        w.status, w.activated_mu = "active", 0.02
        s.commit()
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 8, "version": 0}), 201)
    ids = [ok(submit_group(worker, lease, p, 0))["results"][0]["rollout_id"] for p in lease["prompts"]]
    assert len(ids) == 8

    settings, t0 = api.server.settings, utcnow()

    def tick(k: int) -> None:  # the scheduler's billing, a tick every 10 s
        with api.db.session() as s:
            at = t0 + timedelta(seconds=10 * k)
            billing.bill(s, settings, at, (at - timedelta(seconds=10)).timestamp())
            s.commit()

    for k in range(1, 36):  # 350 s active on the job; the 8 groups wait for the learner's step
        tick(k)
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 0, "max_groups": 8}))
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(0, ids)))
    tick(36)  # 360 s: trained, paid
    with api.db.session() as s:
        entries = s.scalars(select(LedgerEntry).where(LedgerEntry.kind == "worker", LedgerEntry.worker_id == wid)).all()
        paid_s = sum(e.seconds for e in entries)
        earned = s.get_one(Worker, wid).earned_usd
    assert sorted(i for e in entries for i in e.rollout_ids) == sorted(ids)
    assert paid_s == pytest.approx(360.0) and earned == pytest.approx(360.0), (
        f"8 groups delivered at better than the activated rate over 360 s of active time, trained at the step's end, "
        f"were paid {paid_s:.0f} s (${earned:.2f}), not 360 s ($360.00)")


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_billing_ticks_queue_count_reads_the_queues_index_not_every_rollout(api):
    """The tick counts its active workers' queued groups (the pay window above) while it holds their rows' locks:
    a first version counted every worker's with no job named, and SQLite read every group ever stored (review
    finding). Named by job and status, an index on both finds them."""
    workers = [Worker(id="wrk_a", job_id="job_a"), Worker(id="wrk_b", job_id="job_b")]
    with api.db.session() as s:
        engine, seen = s.get_bind(), []

        def capture(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
            seen.append((statement, parameters))

        event.listen(engine, "before_cursor_execute", capture)
        try:
            billing._queued(s, workers)
        finally:
            event.remove(engine, "before_cursor_execute", capture)
        statement, parameters = next((q, p) for q, p in seen if "rollouts" in q)
        plan = [row[-1] for row in s.connection().exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)]
    assert not [step for step in plan if step.startswith("SCAN rollouts")], plan
    assert any("(job_id=? AND status=?)" in step for step in plan), plan  # the queue's (or trained's) index


def test_a_learner_that_reported_its_crash_is_not_billed_while_it_is_relaunched(api, tmp_path):
    """A learner reports its own death (a heartbeat with an error): the scheduler relaunches it at once, and the
    new learner loads its model without heartbeating yet. Billing still reads the dead learner's last heartbeat as
    'alive' for `learner_dead_after_s` (30 s) after it, so the job paid the reserved learner for the dead one's
    next 30 s while nothing ran on it (review finding)."""
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), learner={"price_per_hour": 3600.0})
    t0 = utcnow()
    with api.db.session() as s:  # the last tick ran at t0; the learner reported its crash at t0 + 1 s
        s.merge(SchedulerState(key="last_tick", value={"at": t0.timestamp()}))
        j = s.get_one(Job, job["id"])
        j.learner_launched_at = t0 - timedelta(minutes=5)
        j.learner_heartbeat_at = j.learner_crashed_at = t0 + timedelta(seconds=1)
        j.learner_error = "RuntimeError: CUDA error"
        s.commit()
    _, launched = run_tick(api, now=t0 + timedelta(seconds=2))  # relaunched at once: it reported its death
    assert [j for j, _ in launched] == [job["id"]]
    before = ok(alice.get(f"/v1/jobs/{job['id']}"))["cost"]["learner_usd"]
    for k in range(2, 11):  # the new learner is still loading its model: no heartbeat yet
        run_tick(api, now=t0 + timedelta(seconds=2 * k))
    after = ok(alice.get(f"/v1/jobs/{job['id']}"))["cost"]["learner_usd"]
    assert after - before == 0.0, (
        f"the job paid ${after - before:.2f} (at $1/s) for the 18 s after its learner reported its crash and "
        f"while its relaunch loads, when no learner was alive")
