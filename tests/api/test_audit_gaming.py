"""Cheats that game the audit machinery rather than the sampling, each mounted over HTTP as a worker (and, where
it helps, its provider as a tenant) would: found by a review of the audits as a rational provider would probe
them (docs/RELIABILITY.md, attacks 19-21)."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select

from api.models import Audit, LedgerEntry, Rollout, Worker, utcnow
from scheduler import billing
from scheduler.reconcile import _delivered
from tests.api.test_trust import job_with_worker
from tests.factories import (
    activate,
    fake_model_folder,
    hold,
    new_provider,
    new_user,
    new_worker,
    ok,
    publish,
    running_job,
    step_report,
)

R = 4  # prompts a step
W = 10  # a trusted worker's audit window: round(1 / ECHO2_AUDIT_RATE), public


def _bill(api, seconds: float = 10.0) -> None:
    now = utcnow()
    with api.db.session() as s:
        billing.bill(s, api.server.settings, now, (now - timedelta(seconds=seconds)).timestamp())
        s.commit()


def _working(api, wid: str) -> None:
    """As the scheduler leaves a worker it activated: active, $3600/h (a dollar a second), one group a second."""
    with api.db.session() as s:
        w = s.get_one(Worker, wid)
        w.status, w.price_per_hour, w.activated_mu = "active", 3600.0, 1.0
        s.commit()


def _group(prompt: dict, version: int, k0: int = 0, forged: bool = False, finish: str = "length") -> dict:
    """Two distinct samples of 3 tokens; a forged one is no model's draw (its tokens fail the replay)."""
    first = 900 if forged else 5
    samples = [{"token_ids": [first + k0 + k, 6, 7], "logprobs": [-0.5, -1.0, -0.1], "text": "42",
                "finish_reason": finish} for k in range(2)]
    return {"prompt_id": prompt["prompt_id"], "version": version, "prompt_token_ids": [1, 2, 3], "samples": samples}


def _one_group(api, worker, learner, jid: str, step: int, forged: set[str], forge: bool) -> str:
    """One group on `jid`, forged or honest (added to `forged`); the job's honest learner claims it at once, audits it
    if the control plane picked it (a forged group fails), and trains the rest in `step`; a minute billed. Returns
    the group's id."""
    lease = ok(worker.post("/v1/leases", json={"job_id": jid, "max_prompts": 1, "version": 0}), 201)
    out = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts",
                         json={"groups": [_group(lease["prompts"][0], 0, forged=forge, finish="stop")]}))
    rid = out["results"][0]["rollout_id"]
    assert out["results"][0]["status"] == "accepted", out
    if forge:
        forged.add(rid)
    claimed = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": step, "max_groups": 64}))["groups"]
    kept, failed = [], []
    for g in claimed:
        bad = g["rollout_id"] in forged
        if g["audit"]:
            ok(learner.post(f"/v1/jobs/{jid}/learner/audits", json={"step": step, "audits": [
                {"rollout_id": g["rollout_id"], "passed": not bad, "stats": {"tokens": 6.0},
                 "reason": "replay: tokens the claimed version does not draw" if bad else None}]}))
        (failed if g["audit"] and bad else kept).append(g["rollout_id"])
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(
        step, kept, rejected=[{"rollout_id": r, "reason": "failed its audit"} for r in failed])))
    _bill(api, 60.0)
    return rid


def test_junk_held_back_until_its_version_goes_stale_is_not_paid(api, tmp_path):
    """A worker leases at version 0, renews the lease while the fleet trains, and sends junk (no model run) once
    the step that last admits version 0 has its batch: the door accepts it, the next claim rejects it as stale, and
    no audit ever sees it. It was paid as the platform's fault ($8.00 for 4 groups) and counted as delivered."""
    folder = fake_model_folder(tmp_path / "m")
    _, alice = new_user(api)
    job, learner = running_job(api, alice, folder, staleness=2, max_steps=50, num_prompts=200,
                               grpo={"group_size": 2, "prompts_per_step": R, "max_new_tokens": 3})
    jid = job["id"]
    hid, honest = new_worker(api, new_provider(api, "honest-co")[1], "honest")
    cid, cheater = new_worker(api, new_provider(api, "cheat-co")[1], "cheater")
    for wid in (hid, cid):
        activate(api, wid, jid)
        _working(api, wid)
    lease = ok(cheater.post("/v1/leases", json={"job_id": jid, "max_prompts": R, "version": 0}), 201)
    for step in range(3):  # the honest worker keeps the learner busy; the cheater renews its lease
        if step:
            publish(learner, jid, folder, version=step, step=step)
            hold(honest, *range(step + 1))
        h = ok(honest.post("/v1/leases", json={"job_id": jid, "max_prompts": R, "version": step}), 201)
        ok(honest.post(f"/v1/leases/{h['id']}/rollouts", json={"groups": [_group(p, step) for p in h["prompts"]]}))
        claimed = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": step, "max_groups": R}))["groups"]
        assert {g["worker_id"] for g in claimed} == {hid}
        ok(cheater.post(f"/v1/leases/{lease['id']}/renew"))
        if step == 2:  # version 0 is admissible for this step only, whose batch is full: the junk goes in now
            sent = ok(cheater.post(f"/v1/leases/{lease['id']}/rollouts", json={
                "groups": [_group(p, 0, 10 * i, forged=True) for i, p in enumerate(lease["prompts"])]}))
            assert all(r["status"] == "accepted" for r in sent["results"]), sent
        audits = [{"rollout_id": g["rollout_id"], "passed": True, "reason": None, "stats": {"tokens": 6.0}}
                  for g in claimed if g["audit"]]
        ok(learner.post(f"/v1/jobs/{jid}/learner/steps",
                        json=step_report(step, [g["rollout_id"] for g in claimed], audits=audits)))
        _bill(api)
    assert ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 3, "max_groups": R}))["rejected_stale"] == R
    _bill(api)

    with api.db.session() as s:
        junk = list(s.scalars(select(Rollout).where(Rollout.worker_id == cid)))
        assert {r.reject_kind for r in junk} == {"stale_at_claim"}
        assert not s.scalars(select(Audit).where(Audit.worker_id == cid)).all()  # no audit ever saw it
        paid = s.scalars(select(LedgerEntry).where(LedgerEntry.worker_id == cid, LedgerEntry.kind == "worker")).all()
        delivered, _ = _delivered(s, cid, utcnow() - timedelta(hours=1))
        honest_paid = s.scalars(select(LedgerEntry).where(LedgerEntry.worker_id == hid)).all()
    assert sum(e.amount_usd for e in paid) == 0 and delivered == 0
    assert sum(e.groups for e in honest_paid) == 3 * R  # trained groups are paid as before


def test_a_worker_that_turns_honest_at_each_strike_is_quarantined_at_its_second(api, tmp_path):
    """A trusted worker forges until an audit strikes it, sends the 20 honest groups that make a suspect trusted
    again, and forges again. Its strike was cleared with its trust, so it never reached two: never quarantined,
    and paid for every forged group no audit picked, cycle after cycle."""
    job, learner, wid, worker, _, _ = job_with_worker(api, tmp_path, staleness=64)
    jid = job["id"]
    _working(api, wid)
    forged: set[str] = set()
    step, claimed, failed = 0, [], set()

    def send(forge: bool) -> None:
        """One group; the learner claims it at once and audits it if the control plane picked it (learner/loop.py)."""
        lease = ok(worker.post("/v1/leases", json={"job_id": jid, "max_prompts": 1, "version": 0}), 201)
        group = _group(lease["prompts"][0], 0, forged=forge, finish="stop")  # the job's samples may be longer
        out = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))
        rid = out["results"][0]["rollout_id"]
        if forge:
            forged.add(rid)
        for g in ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": step, "max_groups": 64}))["groups"]:
            claimed.append(g["rollout_id"])
            if g["audit"]:
                bad = g["rollout_id"] in forged
                failed.update({g["rollout_id"]} if bad else set())
                ok(learner.post(f"/v1/jobs/{jid}/learner/audits", json={"step": step, "audits": [
                    {"rollout_id": g["rollout_id"], "passed": not bad, "stats": {"tokens": 6.0},
                     "reason": "replay: tokens the claimed version does not draw" if bad else None}]}))

    def commit() -> None:
        nonlocal step, claimed
        ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(
            step, [r for r in claimed if r not in failed],
            rejected=[{"rollout_id": r, "reason": "failed its audit"} for r in claimed if r in failed])))
        _bill(api, 60.0)
        step, claimed = step + 1, []

    def trust() -> str:
        return ok(worker.get(f"/v1/workers/{wid}"))["trust"]

    for _ in range(5):  # probation, honestly
        send(False)
    assert trust() == "trusted"
    commit()
    while trust() == "trusted":  # forge until an audit catches it
        send(True)
    assert trust() == "suspect"
    commit()  # the step trains the forged groups no audit picked: they are paid for now
    while trust() == "suspect":  # honest, every group audited, until trusted again
        send(False)
    commit()
    assert trust() == "trusted"  # the first cycle went as before
    while trust() == "trusted":  # and forges again
        send(True)

    assert trust() == "quarantined"
    with api.db.session() as s:
        entries = s.scalars(select(LedgerEntry).where(LedgerEntry.worker_id == wid)).all()
        kept = {r for e in entries if e.kind == "worker" and e.clawed_back_by is None for r in e.rollout_ids}
    assert not forged & kept  # what it was paid is taken back


def test_a_worker_moved_to_another_job_keeps_no_lease_on_the_one_it_left(api, tmp_path):
    """A provider that is also a tenant keeps its trusted worker's lease on its own cheap job (one group a step)
    after the scheduler moves the worker to Bob's, spends it one group at a time, reads its own job's audits (the
    owner sees each at once) to learn when the worker's audit window (numbered across every job) had its pick,
    and forges the rest of that window on Bob's job: 14-22 forged groups in four windows, trained and paid."""
    _, mallory = new_user(api, "mallory")
    own, _ = running_job(api, mallory, fake_model_folder(tmp_path / "m"), staleness=64, max_steps=1000,
                         num_prompts=400, grpo={"group_size": 2, "prompts_per_step": 1, "max_new_tokens": 3})
    _, bob = new_user(api, "bob")
    victim, _ = running_job(api, bob, fake_model_folder(tmp_path / "b"), staleness=4, max_steps=50,
                            num_prompts=400, grpo={"group_size": 2, "prompts_per_step": 256, "max_new_tokens": 3})
    wid, worker = new_worker(api, new_provider(api, "mallory-co")[1], "w")
    activate(api, wid, own["id"])
    probes = ok(worker.post("/v1/leases", json={"job_id": own["id"], "max_prompts": 50, "version": 0}), 201)

    activate(api, wid, victim["id"])  # the scheduler's move (reconcile: fleet.assign)

    r = worker.post(f"/v1/leases/{probes['id']}/renew")
    assert r.status_code == 409 and "released" in r.json()["detail"], r.text
    out = ok(worker.post(f"/v1/leases/{probes['id']}/rollouts", json={"groups": [_group(probes["prompts"][0], 0)]}))
    assert out["results"][0]["status"] == "rejected", out
    states = {p["state"] for p in ok(mallory.get(f"/v1/jobs/{own['id']}/prompts", params={"limit": 200}))["items"]}
    assert "leased" not in states  # its prompts went back to the pool


def test_a_window_whose_audit_was_seen_on_the_owners_own_job_is_not_finished_on_another_tenants(api, tmp_path):
    """A worker's audit windows cut the one sequence of its groups on every job, and a job's owner sees each of its
    audits at once: Mallory's trusted worker served her own job one group at a time until its window's audit showed,
    she cancelled the job, and the scheduler moved the worker to Bob's, where it forged the rest of that window,
    unaudited, trained and paid (review finding). A move now starts a new window (fleet.assign)."""
    _, mallory = new_user(api, "mallory")
    own, own_learner = running_job(api, mallory, fake_model_folder(tmp_path / "m"), staleness=64, max_steps=1000,
                                   num_prompts=400, grpo={"group_size": 2, "prompts_per_step": 64})
    _, bob = new_user(api, "bob")
    victim, bob_learner = running_job(api, bob, fake_model_folder(tmp_path / "b"), staleness=64, max_steps=1000,
                                      num_prompts=400, grpo={"group_size": 2, "prompts_per_step": 64})
    wid, worker = new_worker(api, new_provider(api, "mallory-co")[1], "w")
    activate(api, wid, own["id"])
    _working(api, wid)
    forged: set[str] = set()
    steps = {own["id"]: 0, victim["id"]: 0}
    learners = {own["id"]: own_learner, victim["id"]: bob_learner}

    def send(jid: str, forge: bool) -> str:
        steps[jid] += 1
        return _one_group(api, worker, learners[jid], jid, steps[jid] - 1, forged, forge)

    def me() -> dict:
        return ok(worker.get(f"/v1/workers/{wid}"))

    for _ in range(5):  # probation on Mallory's own job, honestly
        send(own["id"], False)
    assert me()["trust"] == "trusted"

    # Mallory's worker sends one honest group at a time on her job; Mallory, its owner, sees every audit at once.
    left = 0
    for _ in range(6 * W):
        seq = me()["accepted_rollouts"]  # the number the next group gets (every accepted group, every job)
        rid = send(own["id"], False)
        audited = {a["rollout_id"] for a in ok(mallory.get(f"/v1/jobs/{own['id']}/audits"))}
        if rid in audited and W - 1 - seq % W >= 3:  # the window's one audit is behind it, 3+ slots still to come
            left = W - 1 - seq % W
            break
    assert left, "no early pick seen in six windows"

    ok(mallory.post(f"/v1/jobs/{own['id']}/cancel"))  # the worker leaves her job...
    activate(api, wid, victim["id"])  # ...and the scheduler puts it on Bob's (reconcile: fleet.assign)
    _working(api, wid)
    sent: list[str] = []
    while len(sent) < W and me()["trust"] == "trusted":  # forged, on Bob's job, until an audit catches one
        sent.append(send(victim["id"], True))
    with api.db.session() as s:
        first = s.scalar(select(func.min(Rollout.seq)).where(Rollout.id.in_(sent)))
    assert first % W == 0, f"the window Mallory saw the audit of went on on Bob's job ({left} slots left)"
    audited_on_bob = {a["rollout_id"] for a in ok(bob.get(f"/v1/jobs/{victim['id']}/audits"))}
    assert len(audited_on_bob & set(sent)) == 1 and me()["trust"] == "suspect"
