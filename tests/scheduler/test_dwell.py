"""Once a worker's dwell time is over, a cheaper set that qualifies replaces it (planner/triggers.py)."""

from datetime import timedelta

from api.models import utcnow
from scheduler import hosts
from scheduler.reconcile import tick
from tests.factories import (
    fake_model_folder,
    new_provider,
    new_user,
    new_worker,
    ok,
    running_job,
    step_report,
    submit_group,
)


def _tick(api, settings, now):
    with api.db.session() as s:
        hosts.register(s, "test-learner-host", 8, now)
        s.commit()
    launched = []
    with api.db.session() as s:
        tick(s, settings, lambda job, token, _: launched.append(token), now=now)
    return launched


def test_an_expensive_worker_is_replaced_by_a_cheaper_set_once_its_dwell_time_is_over(api, tmp_path):
    """A $10/h worker is activated alone; five $1/h workers join while it is within its dwell time (60 s), so
    it is kept. After the dwell time nothing re-solved (the end of a dwell time triggered only while some job was
    short), and the job kept paying $10/h where $4-5/h meets its rule, for as long as the worker's measured rate
    stayed within 10 %."""
    # A clock that jumps ahead: workers and the learner are not declared dead meanwhile.
    settings = api.server.settings.model_copy(update={"worker_offline_after_s": 1e6, "learner_dead_after_s": 1e6})
    assert settings.min_dwell_s == 60
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    jid = job["id"]
    _, provider = new_provider(api)
    eid, e = new_worker(api, provider, "pricey", price_per_hour=10.0)
    ok(e.post(f"/v1/workers/{eid}/heartbeat", json={}))
    t0 = utcnow()
    launched = _tick(api, settings, t0)  # the only worker: activated (and the job's learner launched)
    learner = api.client(launched[0])
    ok(learner.post(f"/v1/jobs/{jid}/learner/start"))
    assert ok(api.admin.get(f"/v1/workers/{eid}"))["job_id"] == jid
    ok(e.post(f"/v1/workers/{eid}/heartbeat", json={"versions_held": [0]}))
    lease = ok(e.post("/v1/leases", json={"job_id": jid, "max_prompts": 2, "version": 0}), 201)
    ids = [ok(submit_group(e, lease, p, 0))["results"][0]["rollout_id"] for p in lease["prompts"]]
    ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 0, "max_groups": 10}))
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(0, ids, t_train_s=1000.0)))  # a slow learner
    cheap = []
    for i in range(5):
        wid, w = new_worker(api, provider, f"cheap{i}", price_per_hour=1.0, rollouts_per_s=1.0)
        ok(w.post(f"/v1/workers/{wid}/heartbeat", json={}))
        cheap.append(wid)
    _tick(api, settings, t0 + timedelta(seconds=59))  # re-solve (T_train, churn): pricey is within its dwell time
    assert ok(api.admin.get(f"/v1/workers/{eid}"))["job_id"] == jid
    for s in (61, 63, 64):  # the dwell time is over; the worker's measured rate moves < 10 %
        _tick(api, settings, t0 + timedelta(seconds=s))
    on_job = [w for w in cheap if ok(api.admin.get(f"/v1/workers/{w}"))["job_id"] == jid]
    pricey = ok(api.admin.get(f"/v1/workers/{eid}"))["job_id"]
    lines = [d["line"] for d in ok(alice.get(f"/v1/jobs/{jid}/decisions"))]
    assert pricey is None and len(on_job) >= 4, (f"the $10/h worker still serves the job ({pricey}) and "
                                                 f"{len(on_job)} of the $1/h ones; decisions: {lines}")
