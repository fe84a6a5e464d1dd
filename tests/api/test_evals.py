"""Held-out evaluation over HTTP: which prompts a job holds out, that they are never leased for training
(checked from the API's records), the learner's reports and the owner's eval curve."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from api.models import Lease, Prompt
from tests.factories import (
    activate,
    fake_model_folder,
    new_provider,
    new_user,
    new_worker,
    ok,
    publish,
    start_learner,
    step_report,
    submit_group,
)
from tests.sdk.test_cli import echo2

ITEMS = [{"prompt": f"say {i}", "reference": str(i)} for i in range(30)]


@pytest.fixture(autouse=True)
def trusted_workers(api, monkeypatch):  # type: ignore[no-untyped-def]
    """No learner audits here: a worker on probation would stop at 8 groups waiting for their verdict."""
    monkeypatch.setattr(api.server.settings, "probation_audits", 0)


def dataset_job(api, alice, **overrides):  # type: ignore[no-untyped-def]
    spec = {"name": "held-out", "base_model": "echo2:tiny", "task": {"name": "exact_match"},
            "prompts": [{"item": it} for it in ITEMS], "grpo": {"group_size": 2, "prompts_per_step": 27},
            "staleness": 2, "max_steps": 3, **overrides}
    return ok(alice.post("/v1/jobs", json=spec), 201)


def test_a_dataset_holds_out_its_fraction_and_they_are_never_leased(api, tmp_path):
    _, alice = new_user(api)
    job = dataset_job(api, alice, eval={"fraction": 0.1, "size": 64})
    jid = job["id"]
    assert job["num_prompts"] == 27  # 3 of 30 held out
    learner = start_learner(api, jid)
    publish(learner, jid, fake_model_folder(tmp_path / "m"), version=0, step=0)
    held = ok(learner.get(f"/v1/jobs/{jid}/learner/eval-prompts"))
    assert len(held) == 3 and all(p["reference"] == p["text"].split()[-1] for p in held)
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, jid)
    assert worker.get(f"/v1/jobs/{jid}/learner/eval-prompts").status_code == 403  # references stay trusted-side
    leased = []
    for _ in range(2):  # lease the whole training pool, twice over an epoch
        lease = ok(worker.post("/v1/leases", json={"job_id": jid, "max_prompts": 30, "version": 0}), 201)
        ids = [ok(submit_group(worker, lease, p, 0))["results"][0]["rollout_id"] for p in lease["prompts"]]
        leased += [p["prompt_id"] for p in lease["prompts"]]
        batch = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": len(leased) // 27 - 1,
                                                                        "max_groups": 30}))
        ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(batch["step"], ids)))
    held_ids = {p["id"] for p in held}
    assert len(leased) == 54 and not held_ids & set(leased)  # two epochs of 27, none of them held out
    with api.db.session() as s:
        assert all(not held_ids & set(lease.prompt_ids) for lease in s.scalars(select(Lease)))
        assert {p.state for p in s.scalars(select(Prompt).where(Prompt.id.in_(held_ids)))} == {"eval"}


def test_a_synthetic_task_holds_out_problems_it_never_trains_on(api):
    _, alice = new_user(api)
    spec = {"name": "held-out-arithmetic", "base_model": "echo2:tiny", "task": {"name": "arithmetic", "params": {
        "max_operand": 9}}, "grpo": {"group_size": 2, "prompts_per_step": 8}, "max_steps": 20}
    job = ok(alice.post("/v1/jobs", json=spec), 201)
    with api.db.session() as s:
        rows = s.scalars(select(Prompt).where(Prompt.job_id == job["id"])).all()
    held = {p.text for p in rows if p.state == "eval"}
    trained = {p.text for p in rows if p.state != "eval"}
    assert len(held) == 19 and len(rows) - len(held) == job["num_prompts"] == 160  # 19 of the 100 sums held out
    assert not held & trained
    listed = ok(alice.get(f"/v1/jobs/{job['id']}/prompts", params={"held_out": True, "limit": 50}))
    assert listed["total"] == 19 and {p["text"] for p in listed["items"]} == held
    assert {p["state"] for p in listed["items"]} == {"eval"}
    assert ok(alice.get(f"/v1/jobs/{job['id']}/prompts"))["total"] == 160  # the training prompts by default


def test_a_small_dataset_holds_nothing_out(api):
    _, alice = new_user(api)
    small = dataset_job(api, alice, prompts=[{"item": it} for it in ITEMS[:9]],
                        grpo={"group_size": 2, "prompts_per_step": 9})
    assert small["num_prompts"] == 9  # 10 % of 9 items is less than one: no held-out split


def test_the_learner_reports_accuracy_and_the_owner_reads_the_curve(api, tmp_path):
    _, alice = new_user(api)
    jid = dataset_job(api, alice)["id"]
    learner = start_learner(api, jid)
    publish(learner, jid, fake_model_folder(tmp_path / "m"), version=0, step=0)
    report = {"step": 0, "version": 0, "prompts": 3, "greedy_accuracy": 0.0, "sampled_accuracy": 1 / 3,
              "sampled_reward_mean": 0.4, "seconds": 1.5}
    ok(learner.post(f"/v1/jobs/{jid}/learner/evals", json=report))
    early = learner.post(f"/v1/jobs/{jid}/learner/evals", json={**report, "step": 1, "version": 1})
    assert early.status_code == 422 and early.json()["errors"][0]["field"] == "step"  # not committed yet
    ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 0}))
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(0, [])))
    ok(learner.post(f"/v1/jobs/{jid}/learner/evals", json={**report, "step": 1, "version": 1,
                                                            "greedy_accuracy": 2 / 3}))
    curve = ok(alice.get(f"/v1/jobs/{jid}/evals"))
    assert [(e["step"], e["greedy_accuracy"]) for e in curve] == [(0, 0.0), (1, 2 / 3)]
    summary = ok(alice.get(f"/v1/jobs/{jid}/report"))
    assert summary["eval_before"]["greedy_accuracy"] == 0.0 and summary["eval_after"]["step"] == 1
    _, bob = new_user(api, "bob")
    assert bob.get(f"/v1/jobs/{jid}/evals").status_code == 404
    scraped = api.admin.get("/metrics").text
    assert f'echo2_job_heldout_accuracy{{decoding="greedy",job="{jid}"}} 0.666' in scraped
    cli = echo2("jobs", "report", jid, url=api.url, key=alice.headers["Authorization"].split()[1])
    assert cli.returncode == 0 and cli.stdout.strip().splitlines()[-1] == (
        "held-out accuracy (3 prompts never trained on): greedy 0.000 -> 0.667, sampled 0.333 -> 0.333 at step 1")
