"""Walk every ID-taking route with another principal's IDs: every answer is 403 or 404.

The route list comes from the live OpenAPI document, so a new ID-taking route without a case here
fails the test until someone decides how it must be protected.
"""

import hashlib
import re

import pytest
from echo2.snapshots import build_manifest

from tests.factories import (
    SHA,
    activate,
    fake_model_folder,
    job_spec,
    new_provider,
    new_user,
    new_worker,
    ok,
    running_job,
    submit_group,
)


def _group(prompt_id):
    sample = {"token_ids": [1], "logprobs": [-0.1], "text": "x", "finish_reason": "stop"}
    return {"groups": [{"prompt_id": prompt_id, "version": 0, "prompt_token_ids": [1], "samples": [sample] * 2}]}


@pytest.fixture
def world(api, tmp_path):
    alice_id, alice = new_user(api, "alice")
    folder = fake_model_folder(tmp_path / "m")
    job, _ = running_job(api, alice, folder)
    dataset = ok(alice.post("/v1/datasets", json={"name": "d", "items": [{"question": "q", "answer": "1"}]}), 201)
    provider_id, provider = new_provider(api, "alice-gpus")
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}), 201)
    key = ok(alice.post(f"/v1/users/{alice_id}/keys"), 201)["token"]["id"]
    upload = ok(alice.post("/v1/datasets/uploads", json={"name": "u", "size": 3,
                                                         "sha256": hashlib.sha256(b"abc").hexdigest()}))
    rollout = ok(submit_group(worker, lease, lease["prompts"][0], 0))["results"][0]["rollout_id"]

    _, bob = new_user(api, "bob")
    bob_job, bob_learner = running_job(api, bob, folder)
    _, bob_provider = new_provider(api, "bob-gpus")
    bob_wid, bob_worker = new_worker(api, bob_provider)
    activate(api, bob_wid, bob_job["id"])
    ids = {"job_id": job["id"], "worker_id": wid, "lease_id": lease["id"], "dataset_id": dataset["id"],
           "user_id": alice_id, "token_id": key, "version": 0, "index": 0, "step": 0, "provider_id": provider_id,
           "upload_id": upload["id"], "rollout_id": rollout}
    attackers = {"user": bob, "provider": bob_provider, "worker": bob_worker, "learner": bob_learner}
    manifest = build_manifest(folder, 1, 1, 64 * 1024).model_dump(mode="json")
    bodies = {
        "create_job": {"json": job_spec(task={"name": "gsm8k"}, dataset_id=dataset["id"])},
        "create_lease": {"json": {"job_id": job["id"], "max_prompts": 1, "version": 0}},
        "worker_heartbeat": {"json": {}},
        "submit_rollouts": {"json": _group(lease["prompts"][0]["prompt_id"])},
        "play_episode_turns": {"json": {"steps": [{"prompt_id": lease["prompts"][0]["prompt_id"], "sample": 0,
                                                   "turn": 0, "action_token_ids": [5]}]}},
        "learner_claim": {"json": {"step": 0}},
        "learner_report_step": {"json": {"step": 0, "rollout_ids": [], "t_train_s": 0}},
        "learner_heartbeat": {"json": {"step": 0}},
        "learner_report_audits": {"json": {"step": 0, "audits": [{"rollout_id": rollout, "passed": True}]}},
        "learner_finish": {"json": {"outcome": "failed"}},
        "upload_chunk": {"content": b"abc", "headers": {SHA: hashlib.sha256(b"abc").hexdigest(),
                                                        "Content-Type": "application/octet-stream"}},
        "publish_version": {"json": {"full": manifest}},
        "commit_learner_checkpoint": {"json": manifest},
        "wait_for_version": {"params": {"after": 0, "timeout_s": 0}},
        "learner_report_eval": {"json": {"step": 0, "version": 0, "prompts": 1, "seconds": 0}},
        "update_job": {"json": {"budget_usd": 1000}},
        "list_step_traces": {"params": {"step": 0}},
        "set_user_quotas": {"json": {"max_concurrent_jobs": 1}},
    }
    bodies["upload_learner_checkpoint_chunk"] = bodies["upload_delta_chunk"] = bodies["upload_chunk"]
    bodies["put_dataset_upload_part"] = bodies["upload_chunk"]
    return ids, attackers, bodies


BODY_ID_ROUTES = {"create_job", "create_lease"}


def test_every_id_taking_route_refuses_other_principals(api, world):
    ids, attackers, bodies = world
    spec = ok(api.client().get("/openapi.json"))
    checked = 0
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            if "{" not in path and op["operationId"] not in BODY_ID_ROUTES:
                continue
            url = re.sub(r"\{(\w+)\}", lambda m: str(ids[m.group(1)]), path)
            kwargs = bodies.get(op["operationId"], {})
            for kind, client in attackers.items():
                r = client.request(method.upper(), url, **kwargs)
                assert r.status_code in (403, 404), f"{kind} {method.upper()} {path}: {r.status_code} {r.text}"
                checked += 1
    assert checked >= 4 * 25
    # and nothing was changed by the attempts
    job = ok(api.admin.get(f"/v1/jobs/{ids['job_id']}"))
    assert job["status"] == "running" and job["version"] == 0
    assert ok(api.admin.get(f"/v1/workers/{ids['worker_id']}"))["status"] != "deregistered"


def test_a_tenant_reads_nothing_of_another_tenants_jobs_through_the_scheduler_or_a_worker(api, tmp_path):
    """The scheduler's lines on Alice's job ("skipped w: serves job <Bob's>") and their triggers ("job set changed:
    +<Bob's>") named Bob's job, and a worker her job was weighed for showed the job it serves now, Bob's, with
    its version and throughput. Admins still read everything."""
    from tests.factories import run_tick

    _, alice = new_user(api, "alice")
    _, bob = new_user(api, "bob")
    mine, _ = running_job(api, alice, fake_model_folder(tmp_path / "a"), name="alice-job")
    theirs, _ = running_job(api, bob, fake_model_folder(tmp_path / "b", seed=1), name="bob-secret-job")
    _, provider = new_provider(api, "gpu-co")
    for i in range(2):
        wid, worker = new_worker(api, provider, f"w{i}", price_per_hour=0.1, rollouts_per_s=100.0)
        ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={}))
    run_tick(api)
    bobs = next(w for w in ok(api.admin.get("/v1/workers"))["items"] if w["job_id"] == theirs["id"])
    lines = ok(alice.get(f"/v1/jobs/{mine['id']}/decisions"))
    assert any(d["worker_id"] == bobs["id"] for d in lines)  # she reads why Bob's worker is not on her job ...
    assert theirs["id"] not in str(lines) and "another job" in str(lines)  # ... not whose job it serves
    assert theirs["id"] in str(ok(api.admin.get(f"/v1/jobs/{mine['id']}/decisions")))
    seen = ok(alice.get(f"/v1/workers/{bobs['id']}"))
    assert (seen["job_id"], seen["version_held"], seen["rollouts_per_s"]) == (None, None, 0.0)
    assert ok(bob.get(f"/v1/workers/{bobs['id']}"))["job_id"] == theirs["id"]  # the job's owner reads it
