"""A clawback that committed while a reconcile tick ran wrote the job's cost and the provider's earnings over with
the values it read before the tick committed: the tick's payments vanished from both, while the job's ledger and the
provider's statement still listed them. Totals are added to in the database now (api/services/totals.py).

`trust.strike` -> `clawback.claw_back` read the job and the provider without locks and wrote `job.workers_usd -=
amount`, `provider.earnings_usd -= total` as absolute values; the tick holds the job's row until it commits, and
the request's UPDATE waited for it and then wrote its stale value (PostgreSQL, READ COMMITTED)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import text

from api.models import Job, SchedulerState, Worker, utcnow
from api.services.fleet import unassign
from scheduler import billing, reconcile
from tests.api.test_trust import trust_of
from tests.factories import (
    activate,
    fake_model_folder,
    new_provider,
    new_user,
    new_worker,
    ok,
    run_tick,
    running_job,
    step_report,
    submit_group,
)


def _working(api, wid: str, job_id: str) -> None:
    with api.db.session() as s:
        w = s.get_one(Worker, wid)
        w.status, w.job_id, w.desired, w.price_per_hour, w.activated_mu = "active", job_id, "active", 3600.0, 1.0
        s.commit()


def _bill(api, seconds: float = 10.0) -> None:
    now = utcnow()
    with api.db.session() as s:
        billing.bill(s, api.server.settings, now, (now - timedelta(seconds=seconds)).timestamp())
        s.commit()


def _lease(worker, jid: str, n: int) -> dict:
    return ok(worker.post("/v1/leases", json={"job_id": jid, "max_prompts": n, "version": 0}), 201)


def _submit(worker, jid: str, n: int) -> list[str]:
    lease = _lease(worker, jid, n)
    return [ok(submit_group(worker, lease, p, 0))["results"][0]["rollout_id"] for p in lease["prompts"]]


def _train(learner, jid: str, step: int) -> None:
    groups = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": step, "max_groups": 64}))["groups"]
    audits = [{"rollout_id": g["rollout_id"], "passed": True, "stats": {"tokens": 6.0, "max_abs_diff": 0.0}}
              for g in groups if g["audit"]]
    report = step_report(step, [g["rollout_id"] for g in groups], audits=audits, audit_s=0.01)
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=report))


def _forged(lease: dict, i: int) -> dict:
    """A group with `turns` on a single-turn job: refused at the door, a strike."""
    samples = [{"token_ids": [5, 6, 7], "logprobs": [-0.5, -1.0, -0.1], "finish_reason": "stop", "turns": [1, 1, 1]},
               {"token_ids": [6, 6, 7], "logprobs": [-0.5, -1.0, -0.1], "finish_reason": "stop"}]
    return {"groups": [{"prompt_id": lease["prompts"][i]["prompt_id"], "version": 0, "prompt_token_ids": [1, 2, 3],
                        "samples": samples}]}


def test_a_clawback_during_a_tick_does_not_erase_the_ticks_payments(api, tmp_path, monkeypatch):
    if not api.db.is_postgres:
        pytest.skip("SQLite serialises the tick and the request: they cannot interleave")
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=2, max_steps=50,
                               num_prompts=200, grpo={"group_size": 2, "prompts_per_step": 64})
    jid = job["id"]
    provider_id, provider = new_provider(api, "two-machines")
    honest_id, honest = new_worker(api, provider, "honest")
    forger_id, forger = new_worker(api, provider, "forger")
    for wid in (honest_id, forger_id):
        activate(api, wid, jid)
        _working(api, wid, jid)
    _bill(api)
    _submit(honest, jid, 2)
    _submit(forger, jid, 2)
    _train(learner, jid, 0)
    _bill(api)  # each paid $4.00 for its 2 groups
    lease = _lease(forger, jid, 2)
    r = ok(forger.post(f"/v1/leases/{lease['id']}/rollouts", json=_forged(lease, 0)))["results"][0]
    assert r["status"] == "rejected" and trust_of(api, forger_id)["trust"] == "suspect"  # one strike
    with api.db.session() as s:  # it goes silent, and the scheduler takes it off the job (its lease ends with it)
        unassign(s, s.get_one(Worker, forger_id))
        s.get_one(Worker, forger_id).status = "offline"
        s.commit()
    _submit(honest, jid, 2)
    _train(learner, jid, 1)  # the honest worker's next 2 groups: the next tick pays them
    with api.db.session() as s:  # the learner as the scheduler launched it: alive, not relaunched
        j = s.get_one(Job, jid)
        j.learner_launched_at = j.learner_heartbeat_at = utcnow()
        s.commit()
    with api.db.session() as s:  # the tick before this one, 10 s ago
        s.merge(SchedulerState(key="last_tick", value={"at": (utcnow() - timedelta(seconds=10)).timestamp()}))
        s.commit()

    answer: dict = {}

    def forge_again() -> None:  # the forger's next junk group, on the lease it lost: its second strike
        answer["r"] = forger.post(f"/v1/leases/{lease['id']}/rollouts", json=_forged(lease, 1))

    real = reconcile._activate

    def submitted_meanwhile(db, settings, now, trouble):
        thread = threading.Thread(target=forge_again)
        thread.start()
        with api.db.engine.connect() as watch:  # until the request waits for a row the tick holds
            for _ in range(100):
                if watch.execute(text("select count(*) from pg_stat_activity where wait_event_type = 'Lock'")).scalar():
                    break
                time.sleep(0.05)
        answer["thread"] = thread
        return real(db, settings, now, trouble)

    monkeypatch.setattr(reconcile, "_activate", submitted_meanwhile)
    run_tick(api)  # pays the honest worker $4.00 for step 1's groups; meanwhile the forger is quarantined
    monkeypatch.undo()
    answer["thread"].join(timeout=30)
    assert answer["r"].status_code == 200, answer["r"].text
    assert trust_of(api, forger_id)["trust"] == "quarantined"

    ledger = ok(alice.get(f"/v1/jobs/{jid}/ledger"))
    kinds = {t["key"]: t["amount_usd"] for t in ledger["by_kind"]}
    assert kinds["worker"] == pytest.approx(12.0) and kinds["clawback"] == pytest.approx(-4.0)
    cost = ok(alice.get(f"/v1/jobs/{jid}"))["cost"]
    st = ok(provider.get("/v1/providers/me/statement"))
    assert st["total_usd"] == pytest.approx(8.0)
    problems = []
    if cost["workers_usd"] != pytest.approx(kinds["worker"] + kinds["clawback"]):
        problems.append(f"job cost says workers ${cost['workers_usd']:.2f}, its ledger "
                        f"${kinds['worker'] + kinds['clawback']:.2f}")
    if st["earnings_usd"] != pytest.approx(st["total_usd"]):
        problems.append(f"provider earnings ${st['earnings_usd']:.2f}, its statement ${st['total_usd']:.2f}")
    assert not problems, "; ".join(problems)
