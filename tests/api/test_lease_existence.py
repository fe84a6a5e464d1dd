"""Another party's id answers as an unknown one does (`api/deps.py::owned_job`: "404 otherwise, so IDs leak
nothing"). `api/routes/leases.py::_own` answered 403 "belongs to another worker" for a lease that exists and 404 for
one that does not, so any worker token told which lease ids exist."""

from __future__ import annotations

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
)


@pytest.mark.parametrize("action", ["renew", "complete", "release", "rollouts", "episodes"])
def test_another_workers_lease_answers_as_a_lease_that_does_not_exist(api, tmp_path, action):
    _, alice = new_user(api, "alice")
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    _, provider = new_provider(api, "alice-gpus")
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}), 201)
    _, rival_provider = new_provider(api, "rival")
    _, rival = new_worker(api, rival_provider, "r")
    prompt = lease["prompts"][0]
    body = {"rollouts": {"groups": [group_body(prompt, 0)]},
            "episodes": {"steps": [{"prompt_id": prompt["prompt_id"], "sample": 0, "turn": 0,
                                    "action_token_ids": [5]}]}}.get(action)

    theirs = rival.post(f"/v1/leases/{lease['id']}/{action}", json=body)
    unknown = rival.post(f"/v1/leases/lse_0000000000000000/{action}", json=body)

    assert (theirs.status_code, unknown.status_code) != (403, 404), "the answers tell an existing lease apart"
    assert theirs.status_code == unknown.status_code
