"""Partial rollouts at the door and at the claim: a sample's tokens carry the versions that produced them
(SampleSubmit.versions), the group's version is its oldest token's, and that version alone decides whether
the group is admissible. Malformed or implausible version tags are refused, each with its own reason."""

from __future__ import annotations

from typing import Any

import pytest

from api.models import Job
from tests.factories import activate, hold, new_job, new_provider, new_user, new_worker, ok, publish, start_learner


def sample(versions: list[list[int]] | None, n: int = 3) -> dict[str, Any]:
    body: dict[str, Any] = {"token_ids": [5] * (n - 1) + [0], "logprobs": [-4.5] * n, "finish_reason": "stop"}
    if versions is not None:
        body["versions"] = versions
    return body


def group(lease: dict[str, Any], i: int, version: int, *samples: dict[str, Any]) -> dict[str, Any]:
    return {"prompt_id": lease["prompts"][i]["prompt_id"], "version": version, "prompt_token_ids": [1, 2, 3],
            "samples": list(samples)}


def submit(worker, lease, *groups):  # type: ignore[no-untyped-def]
    return worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": list(groups)})


def step_to(api, job_id: str, learner, folder, step: int) -> None:  # type: ignore[no-untyped-def]
    """The learner published version `step` after `step` steps (the steps themselves are not what is tested)."""
    publish(learner, job_id, folder, version=step, step=step)
    with api.db.session() as s:
        s.get(Job, job_id).step = step
        s.commit()


def leasing(api, folder, max_prompts: int = 8, **spec: Any):  # type: ignore[no-untyped-def]
    """A partial-rollouts job at version 0 and a worker holding a lease of it: (job, learner, worker id, worker,
    lease)."""
    _, alice = new_user(api)
    job = new_job(alice, partial_rollouts=True, grpo={"group_size": 2, "prompts_per_step": 8, "max_new_tokens": 8},
                  **spec)
    learner = start_learner(api, job["id"])
    publish(learner, job["id"], folder, version=0, step=0)
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": max_prompts, "version": 0}), 201)
    return job, learner, wid, worker, lease


@pytest.fixture
def partial(api, tiny_model_dir):  # type: ignore[no-untyped-def]
    job, learner, _, worker, lease = leasing(api, tiny_model_dir, staleness=1)
    return job, learner, worker, lease


def test_the_oldest_token_decides_admission_at_submit_and_at_claim(api, partial, tiny_model_dir):
    job, learner, worker, lease = partial
    assert lease["sampling"]["partial_rollouts"] is True  # what tells the worker to generate in segments
    step_to(api, job["id"], learner, tiny_model_dir, 1)
    spans = group(lease, 0, 0, sample([[0, 2], [1, 1]]), sample([[0, 3]]))  # step 1 - oldest 0 <= S = 1
    assert ok(submit(worker, lease, spans))["results"][0]["status"] == "accepted"

    step_to(api, job["id"], learner, tiny_model_dir, 2)
    stale = group(lease, 1, 0, sample([[0, 1], [1, 1], [2, 1]]), sample([[1, 1], [2, 2]]))  # 2 - 0 > 1
    fresh = group(lease, 2, 1, sample([[1, 1], [2, 2]]), sample([[2, 3]]))  # leased at 0, started on 1
    stale_result, fresh_result = ok(submit(worker, lease, stale, fresh))["results"]
    assert stale_result["status"] == "rejected" and "stale: step 2 - version 0 > S=1" in stale_result["reason"]
    assert fresh_result["status"] == "accepted"

    # The group accepted at step 1 is of version 0 by its oldest token: too stale to train at step 2.
    batch = ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 2, "max_groups": 8}))
    assert batch["rejected_stale"] == 1
    (claimed,) = batch["groups"]
    assert claimed["version"] == 1 and claimed["samples"][0]["versions"] == [[1, 1], [2, 2]]


@pytest.mark.parametrize(("versions", "tokens", "group_version", "error"), [
    ([[0, 2], [1, 2]], 3, 0, "versions counts add up to 4, but there are 3 tokens"),
    ([[1, 2], [0, 1]], 3, 0, "versions must increase from run to run"),
    ([[0, 2], [0, 1]], 3, 0, "versions must increase from run to run"),
    ([[0, 3], [1, 0]], 3, 0, "greater than or equal to 1"),
    ([[v, 1] for v in range(65)], 65, 0, "at most 64 items"),
    ([[1, 3]], 3, 0, "the oldest token of the group is of version 1"),
    ([[0, 3]], 3, 1, "the oldest token of the group is of version 0"),
])
def test_malformed_versions_are_a_422_that_says_what_to_fix(partial, versions, tokens, group_version, error):
    _, _, worker, lease = partial
    r = submit(worker, lease, group(lease, 0, group_version, sample(versions, tokens), sample(versions, tokens)))
    assert r.status_code == 422 and error in r.text, r.text


def test_versions_the_job_cannot_have_are_refused_as_the_workers_fault(api, partial, tiny_model_dir):
    job, learner, worker, lease = partial
    unpublished = group(lease, 0, 0, sample([[0, 2], [3, 1]]), sample(None))
    result = ok(submit(worker, lease, unpublished))["results"][0]
    assert result["status"] == "rejected"
    assert "tokens of version 3, which was never published (latest 0)" in result["reason"]
    step_to(api, job["id"], learner, tiny_model_dir, 1)
    hold(worker, 0, 1)
    newer = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 2, "version": 1}), 201)
    older = group(newer, 0, 0, sample([[0, 3]]), sample([[0, 1], [1, 2]]))  # begun before its lease's version
    result = ok(submit(worker, newer, older))["results"][0]
    assert result["status"] == "rejected" and "differs from the leased version 1" in result["reason"]


def test_a_job_without_partial_rollouts_refuses_per_token_versions(api, tiny_model_dir):
    _, alice = new_user(api)
    job = new_job(alice, grpo={"group_size": 2, "prompts_per_step": 8, "max_new_tokens": 8})
    assert job["spec"]["partial_rollouts"] is False  # off by default
    learner = start_learner(api, job["id"])
    publish(learner, job["id"], tiny_model_dir, version=0, step=0)
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 2, "version": 0}), 201)
    assert lease["sampling"]["partial_rollouts"] is False
    result = ok(submit(worker, lease, group(lease, 0, 0, sample([[0, 3]]), sample(None))))["results"][0]
    assert result["status"] == "rejected"
    assert "per-token versions sent, but the job does not have partial_rollouts on" in result["reason"]


def test_partial_rollouts_with_a_multi_turn_task_is_refused_at_creation(api):
    _, alice = new_user(api)
    r = alice.post("/v1/jobs", json={"name": "guess", "base_model": "echo2:tiny", "task": {"name": "guess_number"},
                                     "partial_rollouts": True, "max_steps": 5})
    assert r.status_code == 422, r.text
    assert "multi-turn" in r.text and "set partial_rollouts to false" in r.text and "partial_rollouts" in r.text


def test_versions_between_publications_are_neither_leased_nor_taken(api, tiny_model_dir):
    """With publish_period 2 only versions 0, 2, ... exist. Tokens tagged [[0, 1], [1, 2]] passed the door (only
    the newest run was compared with the latest version), and the learner's auditor, asking for version 1's
    weights, raised: the learner died, and the next one that claimed the group too, until the job failed. A lease
    at version 1 was granted as well (a version without probes is held when claimed)."""
    job, learner, wid, worker, lease = leasing(api, tiny_model_dir, max_prompts=4, staleness=3, publish_period=2)
    step_to(api, job["id"], learner, tiny_model_dir, 2)
    between = group(lease, 0, 0, sample([[0, 1], [1, 2]]), sample(None))
    result = ok(submit(worker, lease, between))["results"][0]
    assert result["status"] == "rejected" and ("tokens of version 1, which was never published (this job "
                                               "publishes every 2 steps)") in result["reason"]
    assert ok(api.admin.get(f"/v1/workers/{wid}"))["trust"] == "suspect"  # the worker's fault: a strike
    hold(worker, 0, 1, 2)
    refused = worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 2, "version": 1})
    assert refused.status_code == 409 and "version 1 is not published; the latest is 2" in refused.text
    published = group(lease, 1, 0, sample([[0, 1], [2, 2]]), sample(None))
    assert ok(submit(worker, lease, published))["results"][0]["status"] == "accepted"
