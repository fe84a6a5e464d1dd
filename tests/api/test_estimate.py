"""A job's cost estimated before it runs: refused like a job, learner time from earlier jobs like it, the
workers the capacity rule would activate now, and the estimate a job keeps to compare with its cost."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from api.models import Job, Lease
from tests.factories import (
    activate,
    fake_model_folder,
    job_spec,
    new_job,
    new_provider,
    new_user,
    new_worker,
    ok,
    running_job,
    step_report,
    submit_group,
)


def trained_two_steps(api, owner, folder, t_train_s: float) -> str:  # type: ignore[no-untyped-def]
    """A job like `job_spec()` that trained two steps on a worker's groups; returns the worker's id."""
    job, learner = running_job(api, owner, folder)
    _, provider = new_provider(api, "history-co")
    wid, worker = new_worker(api, provider, "history")
    activate(api, wid, job["id"])
    for step in (0, 1):
        lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 2, "version": 0}), 201)
        ids = [ok(submit_group(worker, lease, p, 0))["results"][0]["rollout_id"] for p in lease["prompts"]]
        ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": step, "max_groups": 10}))
        ok(learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(step, ids, t_train_s=t_train_s)))
    _pin_lease_times(api, wid, held_s=0.1)
    return wid


def _pin_lease_times(api, worker_id: str, held_s: float) -> None:  # type: ignore[no-untyped-def]
    """Each of the worker's leases held for `held_s`, 10 s apart: its measured μ is then the same however
    loaded the machine running the test is (on a loaded one, real lease times made the worker too slow for
    the capacity rule to name it)."""
    with api.db.session() as s:
        leases = list(s.scalars(select(Lease).where(Lease.worker_id == worker_id).order_by(Lease.created_at)))
        first = leases[0].created_at
        for i, lease in enumerate(leases):
            lease.created_at = first + timedelta(seconds=10 * i)
            lease.finished_at = lease.created_at + timedelta(seconds=held_s)
        s.commit()


def test_an_estimate_is_refused_like_a_job_and_creates_nothing(api):
    _, alice = new_user(api)
    for bad in (job_spec(grpo={"group_size": 1}), job_spec(task={"name": "no-such-task"}),
                job_spec(task={"name": "arithmetic", "params": {"max_operand": "many"}}),
                job_spec(staleness=0, publish_period=2), job_spec(dataset_id="ds_not_hers")):
        estimated, created = alice.post("/v1/jobs:estimate", json=bad), alice.post("/v1/jobs", json=bad)
        assert estimated.status_code == created.status_code and estimated.status_code in (404, 422), estimated.text
        assert estimated.json()["errors"] == created.json()["errors"] != []
    assert ok(alice.get("/v1/jobs"))["total"] == 0
    assert api.client().post("/v1/jobs:estimate", json=job_spec()).status_code == 401


def test_without_history_or_workers_the_learner_is_counted_at_the_default(api):
    _, alice = new_user(api)
    e = ok(alice.post("/v1/jobs:estimate", json=job_spec(max_steps=30, learner={"price_per_hour": 3.6})))
    assert e["t_train_s"] == 2.0 and "default" in e["t_train_source"]
    assert e["workers"] == [] and not e["feasible"] and e["workers_usd"] == 0
    assert e["wall_s"] == pytest.approx(60.0) and e["cost_usd"] == pytest.approx(0.06)
    assert any("no worker is available" in line for line in e["assumptions"])
    tight = ok(alice.post("/v1/jobs:estimate", json=job_spec(max_steps=30, budget_usd=0.02,
                                                               learner={"price_per_hour": 3.6})))
    assert any("budget of $0.02 is spent after about 10 of 30 steps" in line for line in tight["assumptions"])


def test_workers_the_job_cannot_use_are_not_counted(api):
    _, alice = new_user(api)
    _, provider = new_provider(api)
    small, _ = new_worker(api, provider, "small", vram_gb=8, price_per_hour=0.5, rollouts_per_s=50.0)
    assert [w["worker_id"] for w in ok(alice.post("/v1/jobs:estimate", json=job_spec()))["workers"]] == [small]
    e = ok(alice.post("/v1/jobs:estimate", json=job_spec(workers={"memory_gb": 100})))
    assert e["workers"] == [] and e["workers_usd"] == 0
    assert any("no worker is available for it now (1 live" in line and "VRAM" in line for line in e["assumptions"])


def test_an_estimate_uses_earlier_steps_of_jobs_like_it_and_names_the_workers(api, tmp_path):
    _, alice = new_user(api)
    measured = trained_two_steps(api, alice, fake_model_folder(tmp_path / "m"), t_train_s=0.3)
    _, provider = new_provider(api, "fast-co")
    fast_id, _ = new_worker(api, provider, "fast", price_per_hour=0.5, rollouts_per_s=50.0)
    e = ok(alice.post("/v1/jobs:estimate", json=job_spec()))
    assert e["t_train_s"] == pytest.approx(0.3) and "2 warmed-up steps of 1 earlier job" in e["t_train_source"]
    named = {w["worker_id"]: w for w in e["workers"]}
    assert named[measured]["mu_source"] == "measured: 4 groups in 2 leases on earlier jobs like this one"
    assert named[measured]["mu"] == pytest.approx(4 / 0.2)
    assert e["throughput"] == pytest.approx(sum(w["mu"] for w in e["workers"]))
    assert e["workers_price_per_hour"] == pytest.approx(sum(w["price_per_hour"] for w in e["workers"]))
    assert e["cost_usd"] == pytest.approx(e["learner_usd"] + e["workers_usd"])
    assert e["wall_s"] == pytest.approx(e["startup_s"] + 5 * e["step_s"])
    assert any("the capacity rule would activate" in line for line in e["assumptions"])
    twice = ok(alice.post("/v1/jobs:estimate", json=job_spec(grpo={"group_size": 2, "prompts_per_step": 8})))
    assert twice["t_train_s"] == pytest.approx(0.6)  # twice the samples per step
    shorter = ok(alice.post("/v1/jobs:estimate", json=job_spec(grpo={"group_size": 2, "prompts_per_step": 4,
                                                                     "max_new_tokens": 100})))
    assert shorter["t_train_s"] == 2.0  # not like it: nothing measured
    claimed = {w["worker_id"]: w["mu_source"] for w in shorter["workers"]}
    assert claimed.get(fast_id, "").startswith("claimed")


def test_a_job_keeps_its_estimate_and_reports_it_beside_its_cost(api):
    _, alice = new_user(api)
    _, provider = new_provider(api)
    new_worker(api, provider, "w", price_per_hour=0.5, rollouts_per_s=50.0)
    e = ok(alice.post("/v1/jobs:estimate", json=job_spec()))
    job = new_job(alice)
    with api.db.session() as s:
        assert s.get(Job, job["id"]).estimate_usd == pytest.approx(e["cost_usd"])
    report = ok(alice.get(f"/v1/jobs/{job['id']}/report"))
    assert report["estimate_usd"] == pytest.approx(e["cost_usd"]) and report["cost_usd"] == 0.0


def test_a_workers_generation_time_is_its_busy_time_a_group_where_it_says_it_is_faster():
    from api.services.estimate import _Rate

    boaster = _Rate(groups=4, submitted=4, busy_s=100.0, gen_total_s=0.04)  # says 10 ms a group, took 25 s
    modest = _Rate(groups=4, submitted=4, busy_s=1.0, gen_total_s=320.0)  # says 80 s a group: taken at its word
    assert boaster.gen_s == pytest.approx(25.0) and modest.gen_s == pytest.approx(80.0)
    assert _Rate().gen_s is None  # nothing measured: the caller falls back to 1 / mu
