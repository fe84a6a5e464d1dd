"""Learner slots and the queue: jobs beyond the learner hosts' slots, or their owner's quotas, wait in
line with their place and reason, and start in order as slots free up; no learner is launched twice."""

from datetime import timedelta

from sqlalchemy import select

from api.models import Job, LedgerEntry, utcnow
from tests.factories import learner_for, new_job, new_user, ok, run_tick


def _job(user, name: str, **overrides) -> str:
    return new_job(user, name=name, **overrides)["id"]


def _get(user, job_id: str) -> dict:
    return ok(user.get(f"/v1/jobs/{job_id}"))


def test_jobs_beyond_the_learner_slots_wait_in_line_and_start_in_order(api):
    _, alice = new_user(api)
    first, second, third = (_job(alice, n) for n in ("first", "second", "third"))
    _, launched = run_tick(api, slots=2)
    assert [j for j, _ in launched] == [first, second]
    assert _get(alice, first)["status_reason"] == "its learner is starting"
    waiting = _get(alice, third)
    assert waiting["status"] == "queued" and waiting["queue_position"] == 1
    assert waiting["status_reason"] == "waiting for a learner, 1st in line: every learner slot is busy (2 of 2)"
    urgent = _job(api.admin, "urgent", priority=10)  # above 0: an admin's to give (check_terms)
    _, launched = run_tick(api, slots=2)
    assert launched == []  # the two launched learners are starting: no relaunch, no new token
    assert (_get(api.admin, urgent)["queue_position"], _get(alice, third)["queue_position"]) == (1, 2)

    ok(learner_for(api, first).post(f"/v1/jobs/{first}/learner/start"))
    assert _get(alice, first)["status_reason"] is None and _get(alice, first)["queue_position"] is None
    ok(alice.post(f"/v1/jobs/{second}/cancel"))
    _, launched = run_tick(api, slots=2)
    assert [j for j, _ in launched] == [urgent]  # priority before age
    _, launched = run_tick(api, slots=3)  # another host joined
    assert [j for j, _ in launched] == [third]


def test_a_multi_gpu_learner_holds_a_slot_per_gpu(api):
    _, alice = new_user(api)
    big = _job(alice, "big", learner={"gpus": 4})
    small = _job(alice, "small")
    _, launched = run_tick(api, slots=4)
    assert [j for j, _ in launched] == [big]
    assert _get(alice, small)["status_reason"] == ("waiting for a learner, 1st in line: every learner slot is "
                                                   "busy (4 of 4)")
    ok(alice.post(f"/v1/jobs/{big}/cancel"))
    third = _job(alice, "third", learner={"gpus": 4})
    _, launched = run_tick(api, slots=4)
    assert [j for j, _ in launched] == [small]
    assert ("its 4-GPU learner needs 4 free slot(s) on one host (the most free on one host: 3; 3 of 4 free in all)"
            in _get(alice, third)["status_reason"])


def test_without_a_learner_host_jobs_wait_and_say_so(api):
    _, alice = new_user(api)
    job = _job(alice, "alone")
    _, launched = run_tick(api, slots=0)
    assert launched == []
    assert "no learner host is up" in _get(alice, job)["status_reason"]


def test_a_user_at_their_concurrent_jobs_quota_waits_while_others_start(api):
    bob_id, bob = new_user(api, "bob")
    _, carol = new_user(api, "carol")
    quotas = ok(api.admin.put(f"/v1/users/{bob_id}/quotas", json={"max_concurrent_jobs": 1}))
    assert quotas["max_concurrent_jobs"] == 1 and quotas["max_usd_per_day"] is None
    assert bob.put(f"/v1/users/{bob_id}/quotas", json={"max_concurrent_jobs": 5}).status_code == 403
    r = api.admin.put(f"/v1/users/{bob_id}/quotas", json={"max_concurrent_jobs": 0})
    assert r.status_code == 422 and "max_concurrent_jobs" in r.text
    b1, b2 = _job(bob, "b1"), _job(bob, "b2")
    c1 = _job(carol, "c1")
    _, launched = run_tick(api, slots=8)
    assert {j for j, _ in launched} == {b1, c1}
    assert _get(bob, b2)["status_reason"] == ("waiting for a learner, 1st in line: your quota allows 1 job at a "
                                              "time (1 running)")
    ok(bob.post(f"/v1/jobs/{b1}/cancel"))
    assert [j for j, _ in run_tick(api, slots=8)[1]] == [b2]


def test_a_user_over_their_daily_quota_has_jobs_paused_until_the_spending_rolls_off(api):
    dave_id, dave = new_user(api, "dave")
    job = _job(dave, "spender")
    run_tick(api)
    ok(learner_for(api, job).post(f"/v1/jobs/{job}/learner/start"))
    ok(api.admin.put(f"/v1/users/{dave_id}/quotas", json={"max_usd_per_day": 1.0}))
    now = utcnow()
    with api.db.session() as s:  # what the ledger held: $1.50 spent an hour ago
        s.add(LedgerEntry(job_id=job, kind="learner", amount_usd=1.5, seconds=2700,
                          created_at=now - timedelta(hours=1)))
        s.commit()
    _, launched = run_tick(api, now=now)
    got = _get(dave, job)
    assert got["status"] == "paused" and got["paused_for"] == "quota" and launched == []
    assert "daily quota of $1.00 is spent ($1.50" in got["status_reason"]
    later = now + timedelta(hours=22)  # the entry is still inside the last 24 hours
    assert run_tick(api, now=later)[1] == [] and _get(dave, job)["status"] == "paused"
    queued_too = _job(dave, "waiting")
    run_tick(api, now=later)
    assert _get(dave, queued_too)["paused_for"] == "quota"  # not launched only to be paused
    _, launched = run_tick(api, now=now + timedelta(hours=24))  # the entry rolled off
    assert [j for j, _ in launched] == [job, queued_too]
    with api.db.session() as s:
        assert s.scalar(select(Job.status).where(Job.id == job)) == "queued"
