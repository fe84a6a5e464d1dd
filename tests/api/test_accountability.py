"""What catching a cheat costs the cheater, over HTTP: a worker on probation has a bounded number of groups
waiting for their verdict, verdicts sent before the step commits move its trust at once, a group of copied
samples is audited whatever the sender's trust, pay is clawed back from a worker shut out (ledger entries
naming the rollouts), a quarantine puts its provider on watch and a ban bans the provider; the sequential
tests strike a worker whose audits drift, and the fleet comparison makes an outlier a suspect."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from api.models import Job, LedgerEntry, Provider, Rollout, Worker, utcnow
from api.services import evidence
from tests.api.test_trust import job_with_worker, one_step, submit, trust_of
from tests.factories import new_worker, ok, step_report, submit_group


@pytest.fixture
def setup(api, tmp_path):
    return job_with_worker(api, tmp_path)


def test_a_worker_on_probation_has_at_most_one_lease_of_groups_awaiting_their_verdict(api, setup):
    job, learner, wid, worker, _, _ = setup
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 64, "version": 0}), 201)
    assert len(lease["prompts"]) == 8  # the lease room is far larger; probation bounds it
    refused = worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 8, "version": 0})
    assert refused.status_code == 409
    assert f"its active leases ({lease['id']}) hold 8 prompts" in refused.json()["detail"]
    assert refused.headers["Retry-After"] == "1"
    for p in lease["prompts"]:
        ok(submit_group(worker, lease, p, 0))
    claimed = ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 0, "max_groups": 64}))["groups"]
    assert len(claimed) == 8 and all(g["audit"] for g in claimed)
    assert worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 8, "version": 0}).status_code == 409
    verdicts = [{"rollout_id": g["rollout_id"], "passed": True, "stats": {"z": 0.1}} for g in claimed]
    recorded = ok(learner.post(f"/v1/jobs/{job['id']}/learner/audits", json={"step": 0, "audits": verdicts}))
    assert recorded["recorded"] == 8
    assert trust_of(api, wid)["trust"] == "trusted"  # 5 passed audits, before the step committed
    assert ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 16, "version": 0}), 201)
    # The step's report repeats the verdicts: they count once.
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/steps",
                    json=step_report(0, [g["rollout_id"] for g in claimed], audits=verdicts)))
    assert trust_of(api, wid)["audits_passed"] == 8


def test_a_failed_audit_sent_early_strikes_once(api, setup):
    job, learner, wid, worker, _, _ = setup
    submit(worker, job, 2)
    claimed = ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 0, "max_groups": 8}))["groups"]
    bad = {"rollout_id": claimed[0]["rollout_id"], "passed": False, "reason": "replay: 3 of 6 tokens"}
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/audits", json={"step": 0, "audits": [bad]}))
    assert trust_of(api, wid)["trust"] == "suspect"
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(
        0, [claimed[1]["rollout_id"]], audits=[bad],
        rejected=[{"rollout_id": bad["rollout_id"], "reason": "failed its audit: replay"}])))
    with api.db.session() as s:
        assert s.get(Worker, wid).strikes == 1 and s.get(Worker, wid).audits_failed == 1
    wrong_step = learner.post(f"/v1/jobs/{job['id']}/learner/audits", json={"step": 3, "audits": [bad]})
    assert wrong_step.status_code == 409


def test_a_group_of_copied_samples_is_audited_whatever_its_senders_trust(api, tmp_path):
    job, learner, wid, worker, _, _ = job_with_worker(api, tmp_path)
    one_step(api, job, learner, worker, [True] * 5, step=0)
    assert trust_of(api, wid)["trust"] == "trusted"
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 20, "version": 0}), 201)
    copied = {"token_ids": [9, 6, 7], "logprobs": [-0.5, -1.0, -0.1], "finish_reason": "stop"}
    for p in lease["prompts"]:
        ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [
            {"prompt_id": p["prompt_id"], "version": 0, "prompt_token_ids": [1, 2, 3], "samples": [copied] * 2}]}))
    claimed = ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 1, "max_groups": 64}))["groups"]
    assert len(claimed) == 20 and all(g["audit"] for g in claimed)  # a trusted worker's are 1 in 10 otherwise


def _paid(api, job_id: str, worker_ids: list[str]) -> None:
    """The scheduler's billing pays the workers for their trained groups."""
    from scheduler import billing

    now = utcnow()
    with api.db.session() as s:
        for wid in worker_ids:
            w = s.get(Worker, wid)
            w.status, w.job_id, w.desired, w.price_per_hour, w.activated_mu = "active", job_id, "active", 3600.0, 1.0
            w.unbilled = {job_id: 5.0}
        billing.bill(s, api.server.settings, now, (now - timedelta(seconds=5)).timestamp())
        s.commit()


def test_a_worker_shut_out_is_paid_nothing_and_its_provider_answers_for_it(api, tmp_path):
    job, learner, wid, worker, provider, _ = job_with_worker(api, tmp_path, staleness=16)  # 20 steps on version 0
    other_id, other = new_worker(api, provider, "sibling")
    one_step(api, job, learner, worker, [True] * 5, step=0)
    _paid(api, job["id"], [wid])
    with api.db.session() as s:
        assert s.get(Worker, wid).earned_usd > 0
    for step in range(1, 21):  # forging from here on: audited within 20 groups, then quarantined
        one_step(api, job, learner, worker, [False], step=step)
        if trust_of(api, wid)["trust"] == "quarantined":
            break
    assert trust_of(api, wid)["trust"] == "quarantined"
    with api.db.session() as s:
        entries = list(s.scalars(select(LedgerEntry).where(LedgerEntry.worker_id == wid)))
        paid = [e for e in entries if e.kind == "worker"]
        back = [e for e in entries if e.kind == "clawback"]
        assert len(back) == 1 and back[0].amount_usd == pytest.approx(-sum(e.amount_usd for e in paid))
        assert sorted(back[0].rollout_ids) == sorted(r for e in paid for r in e.rollout_ids)
        assert all(e.clawed_back_by == back[0].id for e in paid) and "quarantined" in back[0].memo
        assert s.get(Worker, wid).earned_usd == pytest.approx(0.0, abs=1e-12)
        assert s.get(Job, job["id"]).workers_usd == pytest.approx(0.0, abs=1e-12)
        assert s.get(Provider, s.get(Worker, wid).provider_id).watch_until is not None
    statement = ok(provider.get("/v1/providers/me/statement"))
    assert statement["total_usd"] == pytest.approx(0.0, abs=1e-12)
    me = ok(provider.get("/v1/providers/me"))
    assert me["watch_until"] and "quarantined" in me["standing_reason"]
    # On watch: a new worker of the provider starts on probation and stays there however many audits it passes.
    fresh_id, _ = new_worker(api, provider, "fresh")
    with api.db.session() as s:
        fresh = s.get(Worker, fresh_id)
        assert fresh.trust == "probation"
        from api.services import trust
        for _ in range(10):
            trust.passed(s, fresh, api.server.settings)
        assert fresh.trust == "probation"
    assert trust_of(api, other_id)["trust"] in ("probation", "suspect")


def test_a_ban_bans_the_provider(api, tmp_path):
    job, learner, wid, worker, provider, _ = job_with_worker(api, tmp_path)
    sibling_id, _ = new_worker(api, provider, "sibling")
    with api.db.session() as s:
        w = s.get(Worker, wid)
        w.quarantines = 1  # it was quarantined before: its next strike bans it
        s.commit()
    one_step(api, job, learner, worker, [False], step=0)
    assert trust_of(api, wid)["trust"] == "banned"
    assert trust_of(api, sibling_id)["trust"] == "banned"
    refused = provider.post("/v1/workers", json={"name": "again"})
    assert refused.status_code == 403 and "banned" in refused.json()["detail"]


def test_the_sequential_test_strikes_a_worker_whose_tokens_are_consistently_too_likely(api, setup):
    """Each audit passes on its own (|z| = 2.5 < 6); together they are far from what sampling gives."""
    job, learner, wid, worker, _, _ = setup
    with api.db.session() as s:
        w = s.get(Worker, wid)
        for _ in range(int(evidence.Z_H / (2.5 - evidence.Z_K)) + 1):
            evidence.record(s, w, {"z": 2.5, "replayed": 30.0, "near_ties": 0.0}, "float32", api.server.settings)
        assert w.strikes == 1 and "sequential test" in w.trust_reason and "more likely" in w.trust_reason
        honest = s.get(Worker, wid)
        honest.strikes, honest.evidence = 0, {}
        for z in [0.5, -1.2, 2.1, -0.3, 1.9, -2.0, 0.8] * 50:  # an honest worker's audits
            evidence.record(s, honest, {"z": z, "replayed": 30.0, "near_ties": 0.0}, "float32",
                            api.server.settings)
        assert honest.strikes == 0


def test_the_fleet_comparison_makes_a_worker_with_worse_rewards_a_suspect(api, tmp_path):
    job, learner, wid, worker, provider, _ = job_with_worker(api, tmp_path)
    peer_id, peer = new_worker(api, provider, "peer")
    with api.db.session() as s:
        for w in (wid, peer_id):
            s.get(Worker, w).trust = "trusted"
        s.commit()
    ids = {wid: submit(worker, job, 40), peer_id: []}
    from tests.factories import activate
    activate(api, peer_id, job["id"])
    ids[peer_id] = submit(peer, job, 40)
    with api.db.session() as s:
        for w, rollouts in ids.items():
            for i, rid in enumerate(rollouts):
                r = s.get(Rollout, rid)
                r.status, r.trained_step = "trained", 0
                r.rewards = [0.0, 0.0] if w == wid else [float(i % 2), 1.0]  # the first worker's: always wrong
        s.commit()
        flagged = evidence.compare_fleet(s, job["id"], 0)
        assert flagged == [wid]
        row = s.get(Worker, wid)
        assert row.trust == "suspect" and "reward" in row.trust_reason and "below" in row.trust_reason
        assert s.get(Worker, peer_id).trust == "trusted"
