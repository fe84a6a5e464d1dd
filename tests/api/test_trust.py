"""Worker trust over HTTP: the control plane picks which groups the learner audits, takes the learner's
verdicts, and moves the sender along probation -> trusted <-> suspect -> quarantined -> banned; the
evidence is readable by the worker's provider, and by the job's owner for the audits of its job."""

from __future__ import annotations

from datetime import timedelta

import pytest

from api.models import Rollout, Worker, utcnow
from api.services import trust
from tests.factories import (
    activate,
    fake_model_folder,
    new_provider,
    new_user,
    new_worker,
    ok,
    running_job,
    step_report,
    submit_group,
)
from tests.sdk.test_cli import echo2


def job_with_worker(api, tmp_path, staleness: int = 2):
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=staleness, max_steps=50,
                               num_prompts=200, grpo={"group_size": 2, "prompts_per_step": 64})
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    return job, learner, wid, worker, provider, alice


@pytest.fixture
def setup(api, tmp_path):
    return job_with_worker(api, tmp_path)


def submit(worker, job, n: int, version: int = 0) -> list[str]:
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": n, "version": version}), 201)
    return [ok(submit_group(worker, lease, p, version))["results"][0]["rollout_id"] for p in lease["prompts"]]


def one_step(api, job, learner, worker, verdicts: list[bool], step: int, queue_meanwhile: int = 0) -> list[dict]:
    """The worker submits len(verdicts) groups; the learner claims them, audits them as asked, and
    reports verdicts[i] for group i (a failed audit is rejected); returns the claimed groups. With
    `queue_meanwhile`, the worker submits that many more while the step trains (they stay queued)."""
    jid = job["id"]
    submit(worker, job, len(verdicts))
    groups = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": step, "max_groups": 64}))["groups"]
    if queue_meanwhile:
        submit(worker, job, queue_meanwhile)
    audits = [{"rollout_id": g["rollout_id"], "passed": ok_, "reason": None if ok_ else "logprob mismatch: forged",
               "stats": {"tokens": 6.0, "max_abs_diff": 0.0 if ok_ else 3.2}}
              for g, ok_ in zip(groups, verdicts, strict=True) if g["audit"]]
    failed = {a["rollout_id"] for a in audits if not a["passed"]}
    trained = [g["rollout_id"] for g in groups if g["rollout_id"] not in failed]
    report = step_report(step, trained, audits=audits, audit_s=0.01,
                         rejected=[{"rollout_id": r, "reason": "failed its audit: logprob mismatch"} for r in failed])
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=report))
    return groups


def trust_of(api, wid):
    return ok(api.admin.get(f"/v1/workers/{wid}"))


def test_probation_audits_every_group_then_trusted_workers_a_sample(api, setup):
    job, learner, wid, worker, _, _ = setup
    groups = one_step(api, job, learner, worker, [True] * 5, step=0)
    assert all(g["audit"] for g in groups)
    got = trust_of(api, wid)
    assert got["trust"] == "trusted" and got["audits_passed"] == 5
    sampled = one_step(api, job, learner, worker, [True] * 64, step=1)
    # audit_rate 0.1: one group in each window of 10 (groups 5..68 of this worker: 5 whole windows, 2 cut)
    assert 5 <= sum(g["audit"] for g in sampled) <= 7


def test_a_trusted_worker_that_starts_forging_is_quarantined_within_twenty_of_its_groups(api, tmp_path):
    job, learner, wid, worker, _, _ = job_with_worker(api, tmp_path, staleness=16)  # 20 steps on version 0
    one_step(api, job, learner, worker, [True] * 5, step=0)
    assert trust_of(api, wid)["trust"] == "trusted"
    # Every group forged from here on, caught whenever audited: the audit of its window comes within
    # 2 x 10 - 1 groups (the rest of this window, whose place may be behind, and the next one), then as
    # a suspect its next group is audited too.
    for forged in range(1, 21):
        one_step(api, job, learner, worker, [False], step=forged)
        if trust_of(api, wid)["trust"] == "quarantined":
            break
    assert trust_of(api, wid)["trust"] == "quarantined" and forged <= 20


def test_a_passed_audit_shows_once_its_window_closes(api, setup):
    """Seeing the one audit of its open window, a worker would know the rest goes unaudited and could forge
    it: until the window's last group comes, its provider (and the worker) see neither it nor its count."""
    job, learner, wid, worker, provider, _ = setup
    settings = api.server.settings
    with api.db.session() as s:  # a salt that puts window 6's audit before its last group (69)
        row = s.get(Worker, wid)
        row.trust, row.audit_salt = "trusted", next(
            salt for salt in (f"{k:032d}" for k in range(100))
            if not trust.should_audit(Worker(trust="trusted", audit_salt=salt), Rollout(id="r", seq=69), settings))
        s.commit()
    one_step(api, job, learner, worker, [True] * 5, step=0)
    one_step(api, job, learner, worker, [True] * 64, step=1)  # groups 0..68: windows 0..5 closed, 60..69 open
    with api.db.session() as s:
        seq = {r.id: r.seq for r in s.query(Rollout).filter(Rollout.worker_id == wid)}
    every = ok(api.admin.get(f"/v1/workers/{wid}/audits", params={"limit": 500}))
    hidden = [a for a in every if seq[a["rollout_id"]] >= 60]
    assert len(hidden) == 1
    shown = ok(provider.get(f"/v1/workers/{wid}/audits", params={"limit": 500}))
    assert {a["id"] for a in shown} == {a["id"] for a in every} - {a["id"] for a in hidden}
    assert ok(provider.get(f"/v1/workers/{wid}"))["audits_passed"] == trust_of(api, wid)["audits_passed"] - len(hidden)
    one_step(api, job, learner, worker, [True], step=2)  # group 69 closes the window
    assert len(ok(provider.get(f"/v1/workers/{wid}/audits", params={"limit": 500}))) == len(every) + (
        trust_of(api, wid)["audits_passed"] - len(every))
    assert ok(provider.get(f"/v1/workers/{wid}")) == trust_of(api, wid)

def test_audit_windows_take_exactly_one_group_in_ten_at_a_secret_place(api):
    settings = api.server.settings
    places = []
    for salt in ("a" * 32, "b" * 32):
        sender = Worker(id="wrk_x", trust="trusted", audit_salt=salt)
        audited = [n for n in range(1000) if trust.should_audit(sender, Rollout(id=f"rol_{n}", seq=n), settings)]
        assert [n // 10 for n in audited] == list(range(100))  # one per window of round(1 / 0.1) groups
        places.append([n % 10 for n in audited])
    assert places[0] != places[1] and len(set(places[0])) == 10  # the place varies by window and by worker
    probation = Worker(id="wrk_y", trust="probation", audit_salt="c" * 32)
    assert all(trust.should_audit(probation, Rollout(id="r", seq=n), settings) for n in range(20))
    assert trust.should_audit(None, Rollout(id="r", seq=3), settings)  # a sender no longer known


def test_with_no_probation_a_new_worker_starts_trusted_and_only_a_sample_is_audited(api, tmp_path):
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=2, max_steps=50,
                               num_prompts=200, grpo={"group_size": 2, "prompts_per_step": 64})
    _, provider = new_provider(api)
    api.server.settings.probation_audits = 0
    try:
        wid, worker = new_worker(api, provider)
    finally:
        api.server.settings.probation_audits = 5
    activate(api, wid, job["id"])
    assert trust_of(api, wid)["trust"] == "trusted"
    sampled = one_step(api, job, learner, worker, [True] * 64, step=0)
    assert 5 <= sum(g["audit"] for g in sampled) <= 7  # groups 0..63: one in each window of 10


def test_a_failed_audit_rejects_the_group_and_two_quarantine_the_worker(api, setup):
    job, learner, wid, worker, provider, alice = setup
    groups = one_step(api, job, learner, worker, [True, False, True], step=0)
    got = trust_of(api, wid)
    assert got["trust"] == "suspect" and got["audits_failed"] == 1 and "logprob mismatch" in got["trust_reason"]
    rollouts = {r["id"]: r for r in ok(alice.get(f"/v1/jobs/{job['id']}/rollouts"))["items"]}
    refused = rollouts[groups[1]["rollout_id"]]
    assert refused["status"] == "rejected" and refused["fault"] == "worker" and refused["reject_kind"] == "audit_failed"
    assert refused["audit"] == "failed"
    assert rollouts[groups[0]["rollout_id"]]["status"] == "trained"
    prompt = next(p for p in ok(alice.get(f"/v1/jobs/{job['id']}/prompts", params={"limit": 200}))["items"]
                  if p["id"] == refused["prompt_id"])
    assert prompt["state"] == "available"  # nothing lost

    one_step(api, job, learner, worker, [False], step=1, queue_meanwhile=1)
    got = trust_of(api, wid)
    assert got["trust"] == "quarantined" and got["job_id"] is None and got["quarantined_until"]
    latest = ok(alice.get(f"/v1/jobs/{job['id']}/rollouts", params={"limit": 1}))["items"][0]
    assert latest["status"] == "rejected" and "sender quarantined" in latest["reason"]  # its queue is discarded

    evidence = ok(provider.get(f"/v1/workers/{wid}/audits", params={"passed": "false"}))
    assert len(evidence) == 2 and all(not a["passed"] and a["reason"] for a in evidence)
    assert alice.get(f"/v1/workers/{wid}/audits").status_code in (403, 404)  # not the job owner's to read
    mine = ok(alice.get(f"/v1/jobs/{job['id']}/audits", params={"passed": "false"}))
    assert {a["worker_id"] for a in mine} == {wid} and all(a["worker_trust"] == "quarantined" for a in mine)
    explain = echo2("jobs", "explain", job["id"], url=api.url, key=alice.headers["Authorization"].split()[1])
    assert explain.returncode == 0 and f"audit fail   {wid} (quarantined)" in explain.stdout


def test_quarantine_ends_on_probation_and_a_strike_after_it_bans(api, setup):
    job, learner, wid, worker, _, _ = setup
    one_step(api, job, learner, worker, [False, False], step=0)
    assert trust_of(api, wid)["trust"] == "quarantined"
    with api.db.session() as s:  # as if quarantine_s had passed
        s.get(Worker, wid).quarantined_until = utcnow() - timedelta(seconds=1)
        s.commit()
    ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={}))  # not offline
    with api.db.session() as s:
        from api.services.trust import release_quarantines

        assert release_quarantines(s, utcnow()) == 1
        s.commit()
    assert trust_of(api, wid)["trust"] == "suspect"
    activate(api, wid, job["id"])
    groups = one_step(api, job, learner, worker, [False], step=1)
    assert groups[0]["audit"]  # a suspect has every group audited
    got = trust_of(api, wid)
    assert got["trust"] == "banned" and "banned" in got["trust_reason"]
    with api.db.session() as s:
        s.get(Worker, wid).job_id = job["id"]  # even if something assigned it again
        s.commit()
    refused = worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0})
    assert refused.status_code == 403 and "banned" in refused.json()["detail"]
    beat = ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={}))
    assert "banned" in beat["notice"] and f"/v1/workers/{wid}/audits" in beat["notice"]


def test_a_report_must_account_for_its_rollouts(api, setup):
    job, learner, wid, worker, _, _ = setup
    (rid,) = submit(worker, job, 1)
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 0, "max_groups": 4}))
    both = step_report(0, [rid], rejected=[{"rollout_id": rid, "reason": "x"}])
    assert learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=both).status_code == 422
    stray = step_report(0, [rid], audits=[{"rollout_id": "rol_elsewhere", "passed": True}])
    assert learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=stray).status_code == 422
