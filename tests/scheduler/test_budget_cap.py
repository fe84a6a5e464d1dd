"""A job's budget is checked after a tick has paid, and a payment was not bounded by what the budget had left, so
one tick could spend many times the whole budget (scheduler/billing.py::_budget_left_s bounds it now)."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select

from api.models import Job, Rollout, Worker, utcnow
from scheduler import billing
from tests.api.test_trust import one_step
from tests.factories import activate, fake_model_folder, new_provider, new_user, new_worker, ok, run_tick, running_job


def _working(api, wid: str, job_id: str, mu: float) -> None:
    with api.db.session() as s:
        w = s.get_one(Worker, wid)
        w.status, w.job_id, w.desired, w.activated_mu = "active", job_id, "active", mu
        s.commit()


def _bill(api, seconds: float) -> None:
    now = utcnow()
    with api.db.session() as s:
        billing.bill(s, api.server.settings, now, (now - timedelta(seconds=seconds)).timestamp())
        s.commit()


def test_one_tick_cannot_pay_a_worker_many_times_the_jobs_whole_budget(api, tmp_path):
    """Alice caps her job at $1. A provider registers its worker at $10,000/h (the highest price the API
    accepts) and is activated as the only worker, measured at 0.05 groups/s (a CPU worker). It works five minutes
    for one step of 8 groups (the learner trains a step once its batch is in), which the step trains at once. The
    next reconcile tick pays the pot of 300 s of active time in one entry, and only then checks the budget."""
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"), budget_usd=1.0, staleness=2,
                               max_steps=50, num_prompts=200, grpo={"group_size": 2, "prompts_per_step": 8})
    jid = job["id"]
    _, provider = new_provider(api, "pricey")
    wid, worker = new_worker(api, provider, "w", price_per_hour=10_000.0)
    activate(api, wid, jid)
    _working(api, wid, jid, 0.05)
    with api.db.session() as s:  # its learner as the scheduler launched it (so the tick does not launch another)
        j = s.get_one(Job, jid)
        j.learner_launched_at = j.learner_heartbeat_at = utcnow()
        s.commit()
    run_tick(api)  # the scheduler's first tick: from here on each tick bills the time since the one before
    _working(api, wid, jid, 0.05)  # (the tick's solver may have re-planned the unmeasured worker: it works on)
    for _ in range(15):  # five minutes of its active time on Alice's job, the groups of the step on their way
        now = utcnow()
        with api.db.session() as s:
            billing.bill(s, api.server.settings, now, (now - timedelta(seconds=20)).timestamp())
            s.commit()
    before = ok(alice.get(f"/v1/jobs/{jid}"))
    assert before["status"] == "running" and before["cost"]["total_usd"] < 1.0, before["cost"]
    one_step(api, job, learner, worker, [True] * 8, step=0)  # the step's 8 groups, trained
    run_tick(api)  # pays, then checks the budget
    got = ok(alice.get(f"/v1/jobs/{jid}"))
    spent = got["cost"]["total_usd"]
    assert got["status"] == "paused" and got["paused_for"] == "budget"
    assert spent <= 1.0 + 0.05, (
        f"a job with a budget of $1.00 spent ${spent:.2f} (workers ${got['cost']['workers_usd']:.2f}) in one tick: "
        f"{got['status_reason']}")


def test_work_delivered_beyond_the_budget_is_paid_once_the_budget_is_raised(api, tmp_path):
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"), budget_usd=1.0, staleness=2,
                               max_steps=50, num_prompts=200, grpo={"group_size": 2, "prompts_per_step": 8})
    jid = job["id"]
    """A payment capped by the budget settled every group it named: once the owner raised the budget there was
    nothing left to pay the remainder for. Now the groups past the budget wait (the one straddling it is paid
    what was left)."""
    _, provider = new_provider(api, "pricey-r")
    wid, worker = new_worker(api, provider, "w", price_per_hour=100.0)  # $100/h: 300 s are worth $8.33
    activate(api, wid, jid)
    _working(api, wid, jid, 0.05)
    for _ in range(15):  # 300 s of active time in its pot
        _bill(api, 20)
    one_step(api, job, learner, worker, [True] * 8, step=0)  # 8 groups trained, worth its 300 s
    _bill(api, 0)  # paid, capped at what the $1 budget had left
    got = ok(alice.get(f"/v1/jobs/{jid}"))
    capped = got["cost"]["workers_usd"]
    assert capped <= 1.0 + 1e-6, got["cost"]
    with api.db.session() as s:
        unpaid = s.scalars(select(Rollout.id).where(Rollout.job_id == jid, Rollout.paid_entry_id.is_(None))).all()
    # The owner raises the budget: "what it delivered beyond waits, paid if the budget is raised".
    ok(alice.patch(f"/v1/jobs/{jid}", json={"budget_usd": 100.0}))
    _working(api, wid, jid, 0.05)  # it still serves the job
    _bill(api, 0)
    _bill(api, 0)
    after = ok(alice.get(f"/v1/jobs/{jid}"))["cost"]["workers_usd"]
    assert after > capped + 5.0, (
        f"the worker delivered 8 groups worth ~$8.33 and was paid ${capped:.4f} under the $1 budget; after the budget "
        f"was raised to $100 it has ${after:.4f}: the capped entry settled all 8 groups ({8 - len(unpaid)} of 8 "
        "marked paid), so nothing of the remainder is ever paid for them")
