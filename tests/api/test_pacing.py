"""Paced leasing, the staleness contract: the server leases only what the learner can still train before
the leased version goes stale — (x + S - t + 1) steps of R groups, less what is queued, in flight or
already claimed for this step — and answers the rest with Retry-After. A prompt returned again and
again is leased first."""

from __future__ import annotations

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
    submit_group,
)

R = 4


def setup(api, tmp_path, staleness=1):
    _, alice = new_user(api)
    folder = fake_model_folder(tmp_path / "m")
    job, learner = running_job(api, alice, folder, staleness=staleness, num_prompts=100,
                               grpo={"group_size": 2, "prompts_per_step": R})
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    return job, learner, worker, alice, folder


def lease(worker, job, n, version=0):
    return worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": n, "version": version})


def test_leases_stop_at_what_can_be_trained_before_the_version_goes_stale(api, tmp_path):
    job, learner, worker, _, folder = setup(api, tmp_path)  # S = 1, R = 4: (S + 1) R = 8 ahead at step 0
    first = ok(lease(worker, job, 6), 201)
    assert len(ok(lease(worker, job, 6), 201)["prompts"]) == 2  # trimmed to the room left
    full = lease(worker, job, 1)
    assert full.status_code == 409 and "no room" in full.json()["detail"]
    assert float(full.headers["Retry-After-Ms"]) > 0 and int(full.headers["Retry-After"]) >= 1
    for p in first["prompts"][:R]:
        ok(submit_group(worker, first, p, 0))
    batch = ok(api.client(learner.headers["Authorization"].split()[1]).post(
        f"/v1/jobs/{job['id']}/learner/claim", json={"step": 0, "max_groups": R}))
    ids = [g["rollout_id"] for g in batch["groups"]]
    assert lease(worker, job, 1).status_code == 409  # claimed for this step still counts
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(0, ids)))
    publish(learner, job["id"], folder, version=1, step=1)
    # step 1: version 0 has one step left (R = 4), all of it taken by the 4 groups still leased
    assert lease(worker, job, 1, version=0).status_code == 409
    # version 1 has two: 8, less the 4 in flight
    hold(worker, 0, 1)
    assert len(ok(lease(worker, job, 8, version=1), 201)["prompts"]) == 4


def test_a_prompt_whose_group_was_refused_leaves_its_lease_and_counts_once_where_it_is_leased_again(api, tmp_path):
    job, _, worker, _, _ = setup(api, tmp_path)  # S = 1, R = 4: room for 8 at step 0
    first = ok(lease(worker, job, 8), 201)
    refused = ok(submit_group(worker, first, first["prompts"][0], 0, group_size=3))["results"][0]
    assert refused["status"] == "rejected" and "3 samples" in refused["reason"]  # its prompt is back in the pool
    _, provider = new_provider(api)
    other_id, other = new_worker(api, provider, "other")
    activate(api, other_id, job["id"])
    again = ok(lease(other, job, 4), 201)  # the first lease holds 7 now: room for the one refused
    assert [p["prompt_id"] for p in again["prompts"]] == [first["prompts"][0]["prompt_id"]]
    assert lease(other, job, 1).status_code == 409


def test_synchronous_jobs_lease_one_step_at_a_time(api, tmp_path):
    job, learner, worker, _, _ = setup(api, tmp_path, staleness=0)
    assert len(ok(lease(worker, job, 10), 201)["prompts"]) == R
    assert lease(worker, job, 1).status_code == 409


def test_a_prompt_returned_three_times_goes_first(api, tmp_path):
    job, _, worker, _, _ = setup(api, tmp_path, staleness=4)  # room for 20
    held = ok(lease(worker, job, 2), 201)  # the first two prompts of the order stay leased meanwhile
    for _ in range(3):  # the next two are leased and given back three times
        again = ok(lease(worker, job, 2), 201)
        ok(worker.post(f"/v1/leases/{again['id']}/release"))
    starving = {p["prompt_id"] for p in again["prompts"]}
    ok(worker.post(f"/v1/leases/{held['id']}/release"))  # now available again, and first in the order
    assert {p["prompt_id"] for p in ok(lease(worker, job, 2), 201)["prompts"]} == starving


def test_the_job_report_counts_every_group_by_its_fate(api, tmp_path):
    job, learner, worker, alice, folder = setup(api, tmp_path)  # S = 1
    first = ok(lease(worker, job, 4), 201)
    for p in first["prompts"]:
        ok(submit_group(worker, first, p, 0))
    ids = [g["rollout_id"] for g in ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim",
                                                    json={"step": 0, "max_groups": 2}))["groups"]]
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(0, ids)))
    publish(learner, job["id"], folder, version=1, step=1)
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(1, [])))
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 2, "max_groups": 4}))  # v0 is stale now
    report = ok(alice.get(f"/v1/jobs/{job['id']}/report"))
    assert report["rollouts"] == {"generated": 4, "waiting": 0, "unused": 0, "trained": 2,
                                  "rejected": {"stale_at_claim": 2}}
    assert report["stale_fraction"] == 0.5 and report["wasted_fraction"] == 0.5 and report["step"] == 2
    assert report["learner_idle_s"] >= 0 and report["audits"] == 0
