"""A rational cheating provider displacing an honest worker with fresh free trials (RELIABILITY attack 29).

Attack 2's defence caps an unmeasured worker at `trial_share` (1/4) of a job's need, and a worker whose trial
delivered nothing is measured at zero for ten grace periods. Both are per worker, and a provider registers as many
workers as it likes: four fresh workers at $0/h claiming 10^6 groups/s cover a job's whole need on claims alone,
cost the solver nothing per rollout, and push the honest, measured, delivering worker off the job (its leases
released: its groups in flight come back `lease_ended`, unpaid). They never deliver; when their trials fail the
provider registers four more. The honest worker idles, the job trains nothing, and its owner pays the learner
meanwhile. One provider's workers on trial now count together for at most `trial_share` (scheduler/reconcile.py)."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select

from api.models import Lease, Rollout, Worker, utcnow
from tests.factories import (
    fake_model_folder,
    group_body,
    new_provider,
    new_user,
    new_worker,
    ok,
    run_tick,
    running_job,
    submit_group,
)


def _beat(api, when, *ids) -> None:
    """Each worker's heartbeat as of `when` (the tick's clock), idle or active as the scheduler left it."""
    with api.db.session() as s:
        for wid in ids:
            s.get_one(Worker, wid).last_heartbeat_at = when
        s.commit()


def test_fresh_free_workers_that_never_deliver_cannot_push_a_delivering_worker_off_its_job(api, tmp_path):
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=4, max_steps=1000,
                         num_prompts=400, grpo={"group_size": 2, "prompts_per_step": 8})
    jid = job["id"]
    hid, honest = new_worker(api, new_provider(api, "honest-co")[1], "honest", price_per_hour=1.0,
                             rollouts_per_s=1.0)
    t0 = utcnow()
    _beat(api, t0, hid)
    run_tick(api, now=t0)
    assert ok(api.admin.get(f"/v1/workers/{hid}"))["job_id"] == jid  # the only worker: activated
    with api.db.session() as s:
        s.get_one(Worker, hid).versions_held = [0]
        s.commit()
    lease = ok(honest.post("/v1/leases", json={"job_id": jid, "max_prompts": 8, "version": 0}), 201)
    for p in lease["prompts"][:6]:
        ok(submit_group(honest, lease, p, 0))
    in_flight = lease["prompts"][6:]  # two groups still generating

    t1 = t0 + timedelta(seconds=90)  # past the honest worker's dwell time; it delivered 6 groups in its last minute
    with api.db.session() as s:
        for r in s.scalars(select(Rollout).where(Rollout.worker_id == hid)):
            r.created_at = t1 - timedelta(seconds=30)
        s.get_one(Worker, hid).active_since = t0
        s.get_one(Lease, lease["id"]).expires_at = t1 + timedelta(seconds=30)  # the worker renews it as it works
        s.get_one(Lease, lease["id"]).created_at = t1 - timedelta(seconds=34)  # 6 groups in 4 s
        s.commit()
    _beat(api, t1, hid)
    run_tick(api, now=t1)  # without the attacker: the honest worker is kept
    assert ok(api.admin.get(f"/v1/workers/{hid}"))["job_id"] == jid, \
        ok(api.admin.get(f"/v1/workers/{hid}/placement"))[0]["line"]
    t1 += timedelta(seconds=5)
    _, mallory = new_provider(api, "mallory-co")
    sybils = [new_worker(api, mallory, f"fresh-{k}", price_per_hour=0.0, rollouts_per_s=1e6)[0] for k in range(4)]
    _beat(api, t1, hid, *sybils)
    run_tick(api, now=t1)

    h = ok(api.admin.get(f"/v1/workers/{hid}"))
    why = ok(api.admin.get(f"/v1/workers/{hid}/placement"))[0]["line"]
    on_job = [w for w in sybils if ok(api.admin.get(f"/v1/workers/{w}"))["job_id"] == jid]
    late = honest.post(f"/v1/leases/{lease['id']}/rollouts",
                       json={"groups": [group_body(p, 0) for p in in_flight]}).json()
    assert h["job_id"] == jid, (
        f"the honest worker, which delivered 6 groups in its last minute, was taken off the job for "
        f"{len(on_job)} fresh $0/h workers of one provider that delivered nothing ({h['job_id']=}: {why!r}); "
        f"its two groups in flight came back {[r['status'] + ': ' + (r['reason'] or '') for r in late['results']]}")



def test_a_provider_is_proven_by_a_delivered_group_and_unproven_again_by_a_failed_trial(api):
    from scheduler.reconcile import TRIAL_RETRY, _unproven

    now, grace = utcnow(), api.server.settings.delivery_grace_s
    ids = {}
    for name, accepted, failed_s_ago in (("fresh", 0, None), ("proven", 3, None),
                                         ("failed-lately", 3, grace), ("failed-long-ago", 3, 2 * TRIAL_RETRY * grace)):
        pid, provider = new_provider(api, name)
        wid, _ = new_worker(api, provider, name)
        new_worker(api, provider, f"{name}-spare")  # a worker with no record of its own does not unprove it
        with api.db.session() as s:
            w = s.get_one(Worker, wid)
            w.accepted_rollouts = accepted
            w.trial_failed_at = None if failed_s_ago is None else now - timedelta(seconds=failed_s_ago)
            s.commit()
        ids[name] = pid
    with api.db.session() as s:
        unproven = _unproven(s, list(ids.values()), now, api.server.settings)
    assert sorted(unproven) == sorted([ids["fresh"], ids["failed-lately"]])


def test_a_providers_machines_that_cannot_run_a_job_do_not_dilute_its_others_trial(api):
    """The pooled cap is shared by the provider's trial workers that can run the job: three with too little memory
    for it left the fourth a quarter of a quarter of the need."""
    from planner.capacity import JobProfile, WorkerPerf, WorkerProfile, required_throughput
    from scheduler.reconcile import _share_trials

    job = JobProfile(job_id="job_x", rollouts_per_step=64, t_train_s=10.0, staleness=2, vram_need_gb=24.0)
    cap = api.server.settings.trial_share * required_throughput(job)
    pid, provider = new_provider(api, "fresh-co")
    _, honest_co = new_provider(api, "honest-co")
    measured = new_worker(api, honest_co, "measured", vram_gb=80)[0]
    fresh = [new_worker(api, provider, f"w{k}", vram_gb=80 if k == 0 else 8)[0] for k in range(4)]
    with api.db.session() as s:
        rows = [s.get_one(Worker, w) for w in [measured, *fresh]]
        profiles = {measured: WorkerProfile(measured, 1.0, 80, frozenset(), 1.0, 1.0, 1.0)}
        for w in fresh:
            vram = s.get_one(Worker, w).vram_gb
            profiles[w] = WorkerProfile(w, 0.0, vram, frozenset(), 1e6, 1.0, 1.0,
                                        perf_by_job={"job_x": WorkerPerf(cap, 1.0, 1.0)})
        for r in rows:
            s.expunge(r)
        rows[0].job_id = "job_x"  # the measured worker serves the job (detached rows: no job row is needed)
        _share_trials(s, rows, profiles, {"job_x": job}, utcnow(), api.server.settings)
    assert profiles[fresh[0]].perf_by_job["job_x"].mu == cap  # the only one that can run it: the whole cap
