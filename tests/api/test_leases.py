import time

import pytest

from tests.factories import (
    activate,
    fake_model_folder,
    group_body,
    new_provider,
    new_user,
    new_worker,
    ok,
    running_job,
    step_report,
    submit_group,
)


@pytest.fixture
def setup(api, tmp_path):
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    return job, learner, worker, alice


def lease(worker, job, n=2, version=0):
    return worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": n, "version": version})


def test_lease_gives_server_chosen_prompts_without_answers(api, setup):
    job, _, worker, _ = setup
    got = ok(lease(worker, job, 3), 201)
    assert got["status"] == "active" and len(got["prompts"]) == 3 and got["sampling"]["group_size"] == 2
    assert all(set(p) == {"prompt_id", "text", "context", "seed", "token_ids", "sampling"} for p in got["prompts"])
    assert all(p["token_ids"] is None and p["sampling"] is None for p in got["prompts"])  # a Tinker request's only
    second = ok(lease(worker, job, 3), 201)
    assert not {p["prompt_id"] for p in got["prompts"]} & {p["prompt_id"] for p in second["prompts"]}


@pytest.mark.parametrize("requests", [1, 2, 3])
def test_a_lease_completes_with_its_last_group_whether_sent_at_once_or_in_parts(api, setup, requests):
    """A submission holding every prompt of its lease completes it without counting what the lease has; parts
    leave it active until the last, and a part sent again changes nothing."""
    job, _, worker, _ = setup
    got = ok(lease(worker, job, 3), 201)
    parts = [got["prompts"][k::requests] for k in range(requests)]
    for k, part in enumerate(parts):
        ok(worker.post(f"/v1/leases/{got['id']}/rollouts", json={"groups": [group_body(p, 0) for p in part]}))
        if k:
            ok(worker.post(f"/v1/leases/{got['id']}/rollouts", json={"groups": [group_body(parts[0][0], 0)]}))
        renewed = worker.post(f"/v1/leases/{got['id']}/renew")
        if k < requests - 1:
            assert ok(renewed)["status"] == "active"
        else:
            assert renewed.status_code == 409 and "is completed" in renewed.json()["detail"]


def test_unassigned_worker_cannot_lease(api, setup):
    job, *_ = setup
    _, provider = new_provider(api, "other")
    _, stranger = new_worker(api, provider)
    r = lease(stranger, job)
    assert r.status_code == 403 and r.json()["errors"][0]["field"] == "job_id"


def test_unpublished_or_stale_versions_are_refused(api, setup):
    job, *_ = setup
    _, _, worker, _ = setup
    r = lease(worker, job, version=5)
    assert r.status_code == 409 and "not published" in r.json()["detail"]


def test_submit_accepts_and_is_idempotent(api, setup):
    job, _, worker, alice = setup
    got = ok(lease(worker, job, 2), 201)
    first = ok(submit_group(worker, got, got["prompts"][0], 0))["results"][0]
    assert first["status"] == "accepted" and first["rollout_id"]
    again = ok(submit_group(worker, got, got["prompts"][0], 0))["results"][0]
    assert again == first
    rollouts = ok(alice.get(f"/v1/jobs/{job['id']}/rollouts"))
    assert rollouts["total"] == 1 and len(rollouts["items"][0]["completions"]) == 2  # test_admission: their text


def test_rejections_carry_a_reason_and_return_the_prompt(api, setup):
    job, _, worker, alice = setup
    got = ok(lease(worker, job, 2), 201)
    wrong_size = ok(submit_group(worker, got, got["prompts"][0], 0, group_size=3))["results"][0]
    assert wrong_size["status"] == "rejected" and "group size" in wrong_size["reason"]
    wrong_version = ok(submit_group(worker, got, got["prompts"][1], 1))["results"][0]
    assert wrong_version["status"] == "rejected" and "version" in wrong_version["reason"]
    states = {p["id"]: p for p in ok(alice.get(f"/v1/jobs/{job['id']}/prompts", params={"limit": 200}))["items"]}
    for p in got["prompts"]:
        assert states[p["prompt_id"]]["state"] == "available" and states[p["prompt_id"]]["attempts"] == 1


def test_worker_reported_reward_is_refused(api, setup):
    job, _, worker, _ = setup
    got = ok(lease(worker, job, 1), 201)
    sample = {"token_ids": [1], "logprobs": [-0.1], "text": "x", "finish_reason": "stop", "reward": 1.0}
    group = {"prompt_id": got["prompts"][0]["prompt_id"], "version": 0, "prompt_token_ids": [1],
             "samples": [sample, sample]}
    r = worker.post(f"/v1/leases/{got['id']}/rollouts", json={"groups": [group]})
    assert r.status_code == 422 and any("reward" in e["field"] for e in r.json()["errors"])


def test_misaligned_logprobs_are_422(api, setup):
    job, _, worker, _ = setup
    got = ok(lease(worker, job, 1), 201)
    sample = {"token_ids": [1, 2], "logprobs": [-0.1], "text": "x", "finish_reason": "stop"}
    group = {"prompt_id": got["prompts"][0]["prompt_id"], "version": 0, "prompt_token_ids": [1],
             "samples": [sample, sample]}
    r = worker.post(f"/v1/leases/{got['id']}/rollouts", json={"groups": [group]})
    assert r.status_code == 422 and "logprobs" in r.json()["detail"]


def test_release_returns_unsubmitted_prompts(api, setup):
    job, _, worker, alice = setup
    got = ok(lease(worker, job, 2), 201)
    ok(submit_group(worker, got, got["prompts"][0], 0))
    released = ok(worker.post(f"/v1/leases/{got['id']}/release"))
    assert released["status"] == "released"
    prompts = ok(alice.get(f"/v1/jobs/{job['id']}/prompts", params={"limit": 200}))["items"]
    states = {p["id"]: p["state"] for p in prompts}
    assert states[got["prompts"][0]["prompt_id"]] == "submitted"
    assert states[got["prompts"][1]["prompt_id"]] == "available"
    late = ok(submit_group(worker, got, got["prompts"][1], 0))["results"][0]
    assert late["status"] == "rejected" and "released" in late["reason"]


def test_lease_completes_when_every_prompt_is_answered(api, setup):
    job, _, worker, _ = setup
    got = ok(lease(worker, job, 1), 201)
    ok(submit_group(worker, got, got["prompts"][0], 0))
    assert ok(worker.post(f"/v1/leases/{got['id']}/complete"))["status"] == "completed"


def test_expired_lease_returns_prompts_and_refuses_renewal(api, setup):
    job, _, worker, alice = setup
    api.server.settings.lease_ttl_s = 0.5
    try:
        got = ok(lease(worker, job, 2), 201)
        time.sleep(0.7)
        assert worker.post(f"/v1/leases/{got['id']}/renew").status_code == 409
        late = ok(submit_group(worker, got, got["prompts"][0], 0))["results"][0]
        assert late["status"] == "rejected" and "expired" in late["reason"]
    finally:
        api.server.settings.lease_ttl_s = 30
    prompts = ok(alice.get(f"/v1/jobs/{job['id']}/prompts", params={"limit": 200}))["items"]
    assert all(p["state"] == "available" for p in prompts)


def test_renew_extends(api, setup):
    job, _, worker, _ = setup
    got = ok(lease(worker, job, 1), 201)
    renewed = ok(worker.post(f"/v1/leases/{got['id']}/renew"))
    assert renewed["expires_at"] >= got["expires_at"]


def test_pool_exhaustion_is_409_with_retry_after(api, setup):
    job, _, worker, _ = setup
    ok(lease(worker, job, 40), 201)
    r = lease(worker, job, 1)
    assert r.status_code == 409 and r.headers["retry-after"] == "1"


def test_an_epoch_that_does_not_fill_a_step_is_followed_by_the_next_at_once(api, tmp_path):
    """6 prompts, 4 a step (as 20 and 8): the second step takes the first epoch's last 2 and 2 of the next. The
    next epoch waited for every prompt to be trained, so those last 2, submitted and waiting for that step, held
    it back and the step never filled: the job stalled for good."""
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"), num_prompts=6, staleness=4,
                               grpo={"group_size": 2, "prompts_per_step": 4})
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    first = ok(lease(worker, job, n=4), 201)
    ids = [ok(submit_group(worker, first, p, 0))["results"][0]["rollout_id"] for p in first["prompts"]]
    batch = ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 0, "max_groups": 4}))
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(batch["step"], ids)))
    last = ok(lease(worker, job, n=4), 201)  # the epoch's last 2
    assert len(last["prompts"]) == 2
    for p in last["prompts"]:
        ok(submit_group(worker, last, p, 0))
    following = ok(lease(worker, job, n=4), 201)  # was a 409: "all are leased or awaiting training"
    seeds = {p["prompt_id"]: p["seed"] for p in first["prompts"]}
    assert following["prompts"] and all(p["seed"] != seeds[p["prompt_id"]] for p in following["prompts"])  # epoch 1
