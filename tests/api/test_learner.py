import threading
import time

import pytest

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


@pytest.fixture
def setup(api, tmp_path):
    _, alice = new_user(api)
    folder = fake_model_folder(tmp_path / "m")
    job, learner = running_job(api, alice, folder, staleness=1, max_steps=3)
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    return job, learner, worker, alice, folder


def produce(worker, job, n, version):
    hold(worker, version)
    got = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": n, "version": version}), 201)
    return [ok(submit_group(worker, got, p, version))["results"][0]["rollout_id"] for p in got["prompts"]]


def test_claim_train_report_cycle(api, setup):
    job, learner, worker, alice, _ = setup
    ids = produce(worker, job, 3, 0)
    batch = ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 0, "max_groups": 10}))
    assert {g["rollout_id"] for g in batch["groups"]} == set(ids)
    assert all(g["reference"] is not None and g["samples"] for g in batch["groups"])
    ack = ok(learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(0, ids)))
    assert ack == {"step": 1, "job_status": "running", "stop": False, "cost_usd": 0.0}
    again = ok(learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(0, ids)))
    assert again["step"] == 1
    metrics = ok(alice.get(f"/v1/jobs/{job['id']}/metrics"))
    assert [m["step"] for m in metrics] == [0] and metrics[0]["groups"] == 3
    assert ok(alice.get(f"/v1/jobs/{job['id']}/metrics", params={"since_step": 1})) == []
    trained = ok(alice.get(f"/v1/jobs/{job['id']}/rollouts", params={"status": "trained"}))
    assert trained["total"] == 3 and trained["items"][0]["rewards"] == [1.0, 0.0]
    assert ok(alice.get(f"/v1/jobs/{job['id']}"))["reward_mean"] == 0.5


def test_staleness_is_enforced_at_submit_lease_and_claim(api, setup):
    job, learner, worker, alice, folder = setup  # S = 1
    jid = job["id"]
    kept = ok(worker.post("/v1/leases", json={"job_id": jid, "max_prompts": 1, "version": 0}), 201)
    queued = produce(worker, job, 2, 0)
    first = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 0, "max_groups": 1}))["groups"]
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(0, [first[0]["rollout_id"]])))
    publish(learner, jid, folder, version=1, step=1)
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(1, [])))
    publish(learner, jid, folder, version=2, step=2)
    # step 2 - version 0 > S: the queued group is rejected at claim time and its prompt re-pooled
    batch = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 2, "max_groups": 10}))
    assert batch["groups"] == [] and batch["rejected_stale"] == 1
    stale_id = (set(queued) - {first[0]["rollout_id"]}).pop()
    rows = {r["id"]: r for r in ok(alice.get(f"/v1/jobs/{jid}/rollouts"))["items"]}
    assert rows[stale_id]["status"] == "rejected" and "stale at claim" in rows[stale_id]["reason"]
    prompt = next(p for p in ok(alice.get(f"/v1/jobs/{jid}/prompts", params={"limit": 200}))["items"]
                  if p["id"] == rows[stale_id]["prompt_id"])
    assert prompt["state"] == "available" and prompt["attempts"] == 1
    # a group generated with version 0 is rejected at submit time too
    late = ok(submit_group(worker, kept, kept["prompts"][0], 0))["results"][0]
    assert late["status"] == "rejected" and late["reason"].startswith("stale")
    # and a worker still holding version 0 cannot lease any more
    r = worker.post("/v1/leases", json={"job_id": jid, "max_prompts": 1, "version": 0})
    assert r.status_code == 409 and "fetch version 2" in r.json()["detail"]


def test_the_next_step_is_claimed_while_this_one_trains_and_its_claims_survive_the_commit(api, setup):
    job, learner, worker, _, _ = setup  # S = 1
    jid = job["id"]
    now = produce(worker, job, 2, 0)
    mine = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 0, "max_groups": 2}))["groups"]
    nxt = produce(worker, job, 2, 0)  # version 0 is still admissible at step 1 (S = 1)
    ahead = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 1, "max_groups": 10}))
    assert ahead["step"] == 1 and {g["rollout_id"] for g in ahead["groups"]} == set(nxt)
    r = learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 2})
    assert r.status_code == 409 and r.json()["errors"][0]["field"] == "step"  # one step ahead at most
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(0, [g["rollout_id"] for g in mine])))
    assert {g["rollout_id"] for g in mine} == set(now)
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(1, nxt)))  # still claimed for step 1


def _past_step_0(learner, worker, job, folder):
    """Step 0 trained on one group of version 0, version 1 published: the learner is at step 1."""
    first = produce(worker, job, 1, 0)
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 0, "max_groups": 1}))
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(0, first)))
    publish(learner, job["id"], folder, version=1, step=1)


def test_claiming_ahead_leaves_what_only_this_step_may_train(api, setup):
    job, learner, worker, _, folder = setup  # S = 1
    jid = job["id"]
    _past_step_0(learner, worker, job, folder)
    old = produce(worker, job, 1, 0)  # admissible at step 1, not at step 2
    new = produce(worker, job, 1, 1)
    ahead = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 2, "max_groups": 10}))
    assert [g["rollout_id"] for g in ahead["groups"]] == new and ahead["rejected_stale"] == 0
    now = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 1, "max_groups": 10}))
    assert [g["rollout_id"] for g in now["groups"]] == old


def test_a_claim_takes_the_oldest_version_first_and_each_version_in_arrival_order(api, setup):
    job, learner, worker, _, folder = setup  # S = 1
    jid = job["id"]
    _past_step_0(learner, worker, job, folder)
    new = produce(worker, job, 1, 1) + produce(worker, job, 1, 1)  # queued first
    old = produce(worker, job, 1, 0) + produce(worker, job, 1, 0)
    claimed = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 1, "max_groups": 3}))
    assert [g["rollout_id"] for g in claimed["groups"]] == old + new[:1]
    assert [g["version"] for g in claimed["groups"]] == [0, 0, 1]


def test_ahead_claims_count_against_lease_room_and_go_stale_at_their_own_step(api, tmp_path):
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=1, max_steps=5,
                               grpo={"group_size": 2, "prompts_per_step": 2})
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    jid = job["id"]
    produce(worker, job, 4, 0)  # room at step 0 for version 0: (0 + 1 - 0 + 1) * 2 = 4 groups
    ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 0, "max_groups": 2}))
    ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 1, "max_groups": 2}))
    r = worker.post("/v1/leases", json={"job_id": jid, "max_prompts": 1, "version": 0})
    assert r.status_code == 409 and "no room" in r.json()["detail"]


def test_a_waiting_claim_answers_as_soon_as_a_rollout_arrives(api, setup):
    job, learner, worker, _, _ = setup
    jid = job["id"]
    hold(worker, 0)
    lease = ok(worker.post("/v1/leases", json={"job_id": jid, "max_prompts": 1, "version": 0}), 201)
    start = time.monotonic()
    idle = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 0, "wait_s": 0.5}))
    assert idle["groups"] == [] and time.monotonic() - start >= 0.5
    got: dict = {}
    waiter = threading.Thread(target=lambda: got.update(ok(learner.post(
        f"/v1/jobs/{jid}/learner/claim", json={"step": 0, "wait_s": 20}))))
    waiter.start()
    time.sleep(0.5)
    ok(submit_group(worker, lease, lease["prompts"][0], 0))
    submitted = time.monotonic()
    waiter.join(timeout=30)
    assert len(got["groups"]) == 1 and time.monotonic() - submitted < 1.5  # woken by the submission


def test_reports_are_checked(api, setup):
    job, learner, worker, _, _ = setup
    ids = produce(worker, job, 2, 0)
    r = learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(0, ids))
    assert r.status_code == 409 and "not claimed" in r.json()["detail"]
    assert learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 3}).status_code == 409
    r = learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(2, []))
    assert r.status_code == 409 and r.json()["errors"][0]["field"] == "step"


def test_restart_releases_uncommitted_claims(api, setup):
    job, learner, worker, _, _ = setup
    produce(worker, job, 2, 0)
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 0, "max_groups": 10}))
    reply = ok(learner.post(f"/v1/jobs/{job['id']}/learner/start"))
    assert reply["released"] == 2 and reply["step"] == 0 and reply["version"] == 0
    batch = ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 0, "max_groups": 10}))
    assert len(batch["groups"]) == 2


def test_heartbeat_and_stop_at_max_steps(api, setup):
    job, learner, worker, alice, folder = setup
    for step in range(3):
        ids = produce(worker, job, 1, step)
        ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": step, "max_groups": 5}))
        ack = ok(learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(step, ids)))
        publish(learner, job["id"], folder, version=step + 1, step=step + 1)
    assert ack["stop"] is True
    hb = ok(learner.post(f"/v1/jobs/{job['id']}/learner/heartbeat", json={"step": 3, "busy_s": 3, "wall_s": 4}))
    assert hb["stop"] is True
    done = ok(learner.post(f"/v1/jobs/{job['id']}/learner/finish",
                           json={"outcome": "succeeded", "final_version": 3}))
    assert done["status"] == "succeeded" and done["finished_at"]
    for route, body in (("start", None), ("heartbeat", {"step": 3}), ("claim", {"step": 3})):
        assert learner.post(f"/v1/jobs/{job['id']}/learner/{route}", json=body).status_code == 401  # token revoked


def test_finish_requires_a_published_final_version(api, setup):
    job, learner, *_ = setup
    r = learner.post(f"/v1/jobs/{job['id']}/learner/finish", json={"outcome": "succeeded", "final_version": 9})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "final_version"
    failed = ok(learner.post(f"/v1/jobs/{job['id']}/learner/finish", json={"outcome": "failed", "reason": "oom"}))
    assert failed["status"] == "failed" and failed["status_reason"] == "oom"


def test_learner_token_is_scoped_to_its_job(api, setup):
    job, learner, _, alice, _ = setup
    other = ok(alice.post("/v1/jobs", json={"name": "o", "base_model": "echo2:tiny", "task": {"name": "arithmetic"},
                                            "num_prompts": 16}), 201)
    assert learner.post(f"/v1/jobs/{other['id']}/learner/start").status_code == 403
    assert alice.post(f"/v1/jobs/{job['id']}/learner/start").status_code == 403
    assert alice.post(f"/v1/jobs/{job['id']}/learner/token").status_code == 403
