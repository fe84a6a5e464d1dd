"""Fleet sampling over HTTP without the SDK or models, the test playing the learner host and the worker: a
sampler checkpoint published to the model's fleet job, an `asample` becoming that job's prompt, the door's
checks against the request's own sampling, the host's audit deciding, and the host taking over what the fleet
does not draw. tests/e2e/test_tinker_fleet.py runs the same with real processes, models and the SDK."""

from __future__ import annotations

import httpx
import pytest
from echo2.protocol import PromptState
from sqlalchemy import select

from api.models import Job, Prompt, Rollout, Worker
from api.tinker import fleet
from api.tinker.models import TinkerRequest
from tests.factories import activate, fake_model_folder, new_provider, new_user, new_worker, ok, publish
from tests.tinker.test_routes import claim, key_of, ready_model, report, retrieve, sdk

PROMPT = [1, 2, 3]


@pytest.fixture
def fleet_model(api, tmp_path):
    """A user's model whose checkpoint "sampler-1" is version 1 of its fleet job, served by an active worker:
    (the user's Tinker client, the sampler id, the job id, the worker id, the worker's client)."""
    _, user = new_user(api)
    client = sdk(api, key_of(user))
    session, model_id = ready_model(api, client)
    saved = ok(client.post("/api/v1/save_weights_for_sampler", json={
        "model_id": model_id, "sampling_session_seq_id": 1}))
    work = claim(api, holding=[model_id])["work"]
    order = work["publish"]
    assert order["version"] == 1 and not order["base_published"]
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {order['token']}"}) as learner:
        publish(learner, order["job_id"], fake_model_folder(tmp_path / "v0"), version=0, step=0)
        publish(learner, order["job_id"], fake_model_folder(tmp_path / "v1", seed=1), version=1, step=1)
    report(api, work, step=1, published=1)
    sampler = ok(retrieve(client, saved["request_id"]))["sampling_session_id"]
    worker_id, worker = serving_worker(api, order["job_id"])
    return client, sampler, order["job_id"], worker_id, worker


def serving_worker(api, job_id: str, name: str = "w") -> tuple[str, httpx.Client]:
    """A new worker the scheduler put on the job, holding its versions and at work."""
    _, provider = new_provider(api, f"provider-of-{name}")
    worker_id, worker = new_worker(api, provider, name)
    activate(api, worker_id, job_id)
    ok(worker.post(f"/v1/workers/{worker_id}/heartbeat", json={"status": "active", "versions_held": [0, 1]}))
    return worker_id, worker


def asample(client: httpx.Client, sampler: str, n: int = 2, **params) -> str:
    body = {"sampling_session_id": sampler, "num_samples": n, "prompt": {"chunks": [
        {"type": "encoded_text", "tokens": PROMPT}]}, "sampling_params": {"max_tokens": 4, "temperature": 1.0,
                                                                           **params}}
    return ok(client.post("/api/v1/asample", json=body))["request_id"]


def lease(worker: httpx.Client, job_id: str) -> dict:
    return ok(worker.post("/v1/leases", json={"job_id": job_id, "max_prompts": 8, "version": 1}), 201)


def group(prompt: dict, samples: list[tuple[list[int], str]], **fields) -> dict:
    return {"prompt_id": prompt["prompt_id"], "version": 1, "prompt_token_ids": prompt["token_ids"],
            "samples": [{"token_ids": t, "logprobs": [-1.0] * len(t), "finish_reason": f} for t, f in samples],
            **fields}


def submit(worker: httpx.Client, leased: dict, groups: list[dict]) -> list[dict]:
    return ok(worker.post(f"/v1/leases/{leased['id']}/rollouts", json={"groups": groups}))["results"]


def test_a_request_on_the_newest_checkpoint_is_a_prompt_for_the_fleet_checked_against_its_own_sampling(
        api, fleet_model):
    client, sampler, job_id, _, worker = fleet_model
    request_id = asample(client, sampler, n=2, stop=[9])
    assert ok(retrieve(client, request_id))["queue_state"] == "active"  # waiting on a worker
    leased = lease(worker, job_id)
    [prompt] = leased["prompts"]
    assert prompt["token_ids"] == PROMPT and prompt["text"] == ""
    assert prompt["sampling"] == {"n": 2, "max_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                  "stop_token_ids": [9]}
    bad = {
        "group has 1 samples, but 2 were asked for": group(prompt, [([4, 9], "stop")]),
        "prompt_token_ids differ": {**group(prompt, [([4, 9], "stop")] * 2), "prompt_token_ids": [1, 2]},
        "goes on past the stop token": group(prompt, [([9, 4, 4, 4], "length")] * 2),
        "is not a stop token": group(prompt, [([4, 5], "stop")] * 2),
        "but max_new_tokens is 4": group(prompt, [([4, 5], "length")] * 2),
    }
    for k, (reason, g) in enumerate(bad.items()):
        [result] = submit(worker, leased, [g])
        assert result["status"] == "rejected" and reason in result["reason"], (reason, result)
        _, worker = serving_worker(api, job_id, f"w{k}")  # two strikes quarantine a worker: a new one each time
        leased = lease(worker, job_id)  # refused at the door: the prompt went back to the pool
    with api.db.session() as s:
        assert s.get(TinkerRequest, request_id).status == "fleet"


def test_an_audited_group_answers_its_future_and_a_failed_one_goes_back_with_a_strike(api, fleet_model):
    client, sampler, job_id, worker_id, worker = fleet_model
    request_id = asample(client, sampler)
    leased = lease(worker, job_id)
    [prompt] = leased["prompts"]
    [result] = submit(worker, leased, [group(prompt, [([4, 5, 6, 7], "length"), ([4, 2], "stop")])])
    assert result["status"] == "accepted"
    audit = claim(api, holding=[_model_of(api, job_id)])["work"]  # a new worker: every group is audited
    assert audit["kind"] == "audit" and audit["payload"]["samples"][0] == [[4, 5, 6, 7], [-1.0] * 4]
    assert ok(retrieve(client, request_id))["type"] == "try_again"
    report(api, audit, audit={"passed": False, "reason": "logprob mismatch"})
    with api.db.session() as s:
        assert s.get(Worker, worker_id).trust == "suspect"
        assert s.get(Rollout, result["rollout_id"]).reject_kind == "audit_failed"
    leased = lease(worker, job_id)  # the request is drawn again
    [result] = submit(worker, leased, [group(leased["prompts"][0], [([4, 5, 6, 7], "length")] * 2)])
    audit = claim(api, holding=[_model_of(api, job_id)])["work"]
    report(api, audit, audit={"passed": True})
    answer = retrieve(client, request_id)
    assert answer.headers["content-type"] == "application/x-protobuf"  # the samples, the worker's
    with api.db.session() as s:
        assert s.get(Rollout, result["rollout_id"]).status == "trained"  # so billing pays it
        assert s.get(TinkerRequest, request_id).result["worker"] == worker_id


def test_what_the_fleet_cannot_or_does_not_draw_the_host_samples(api, fleet_model, monkeypatch):
    client, sampler, job_id, _, _ = fleet_model
    model_id = _model_of(api, job_id)
    greedy = asample(client, sampler, temperature=0.0)
    strings = asample(client, sampler, stop=["\n"])
    waiting = asample(client, sampler)
    with api.db.session() as s:
        states = {r.id: r.status for r in s.scalars(select(TinkerRequest).where(
            TinkerRequest.id.in_([greedy, strings, waiting])))}
    assert states == {greedy: "pending", strings: "pending", waiting: "fleet"}
    monkeypatch.setattr(fleet, "FLEET_WAIT_S", 0.0)  # no worker drew it in time
    reply = claim(api, holding=[model_id])
    ran = [w["request_id"] for w in [reply["work"], *reply["more"]]]
    assert ran == [greedy, strings, waiting]  # in the order they were asked
    with api.db.session() as s:
        assert s.scalar(select(Prompt.state).where(Prompt.request_id == waiting)) == PromptState.host


def test_ending_the_session_fails_fleet_requests_and_ends_the_fleet_job(api, fleet_model):
    client, sampler, job_id, worker_id, _ = fleet_model
    request_id = asample(client, sampler)
    session_id = _session_of(api, job_id)
    ok(client.post(f"/api/v1/sessions/{session_id}/finish", json={}))
    assert "session ended" in ok(retrieve(client, request_id))["error"]
    with api.db.session() as s:
        assert s.get(Job, job_id).status == "succeeded"
        assert s.get(Worker, worker_id).job_id is None  # back to the fleet


def _model_of(api, job_id: str) -> str:
    with api.db.session() as s:
        return s.get(Job, job_id).tinker_model_id


def _session_of(api, job_id: str) -> str:
    return _model_of(api, job_id).split(":")[0]


def test_a_worker_holding_a_request_past_the_deadline_loses_it_to_the_host_without_a_strike(
        api, fleet_model, monkeypatch):
    client, sampler, job_id, worker_id, worker = fleet_model
    request_id = asample(client, sampler)
    leased = lease(worker, job_id)
    ok(worker.post(f"/v1/leases/{leased['id']}/renew"))  # renewing does not keep it
    monkeypatch.setattr(fleet, "FLEET_DEADLINE_S", 0.0)
    work = claim(api, holding=[_model_of(api, job_id)])["work"]
    assert work["request_id"] == request_id and work["kind"] == "sample"
    [result] = submit(worker, leased, [group(leased["prompts"][0], [([4, 5, 6, 7], "length")] * 2)])
    assert result["status"] == "rejected" and "went to the learner host" in result["reason"]
    with api.db.session() as s:
        assert s.get(Worker, worker_id).strikes == 0
        assert s.get(Rollout, result["rollout_id"]).reject_kind == "lease_ended"  # late: not paid


def test_a_group_whose_checkpoint_was_saved_again_is_not_audited_against_other_weights(api, fleet_model, tmp_path):
    client, sampler, job_id, worker_id, worker = fleet_model
    model_id = _model_of(api, job_id)
    request_id = asample(client, sampler)
    leased = lease(worker, job_id)
    saved = ok(client.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id,
                                                                     "sampling_session_seq_id": 1}))
    work = claim(api, holding=[model_id])["work"]
    assert work["request_id"] == saved["request_id"] and work["publish"]["version"] == 2
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {work['publish']['token']}"}) as learner:
        publish(learner, job_id, fake_model_folder(tmp_path / "v2", seed=2), version=2, step=2)
    report(api, work, step=1, published=2)  # the name "sampler-1" is version 2 now
    [result] = submit(worker, leased, [group(leased["prompts"][0], [([4, 5, 6, 7], "length")] * 2)])
    assert result["status"] == "accepted"  # version 1 is still admissible (S = 1)...
    with api.db.session() as s:
        rollout = s.get(Rollout, result["rollout_id"])
        assert rollout.status == "rejected" and "saved again" in rollout.reason  # ...but nothing can audit it
        assert s.get(Worker, worker_id).strikes == 0
        assert s.get(TinkerRequest, request_id).status == "pending"  # the host samples it, with the new weights


def test_with_the_fleet_turned_off_the_host_samples_and_publishes_nothing(api, fleet_model, monkeypatch):
    client, sampler, job_id, _, _ = fleet_model
    monkeypatch.setattr(api.server.settings, "tinker_fleet", False)
    request_id = asample(client, sampler)
    model_id = _model_of(api, job_id)
    ok(client.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id, "sampling_session_seq_id": 2}))
    sample = claim(api, holding=[model_id])["work"]
    assert sample["request_id"] == request_id  # the host's, at once
    report(api, sample, sample={"sequences": []})
    save = claim(api, holding=[model_id])["work"]
    assert save["kind"] == "save_weights_for_sampler" and save["publish"] is None


def _inflight_model(api, tmp_path):
    """A user's model whose first save is in-flight: its fleet job has partial rollouts, version 1 is
    "sampler-1", and a worker serves it."""
    _, user = new_user(api, "inflight")
    client = sdk(api, key_of(user))
    _, model_id = ready_model(api, client)
    saved = ok(client.post("/api/v1/save_weights_for_sampler", json={
        "model_id": model_id, "sampling_session_seq_id": 1, "kind": "inflight"}))
    work = claim(api, holding=[model_id])["work"]
    order = work["publish"]
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {order['token']}"}) as learner:
        publish(learner, order["job_id"], fake_model_folder(tmp_path / "v0"), version=0, step=0)
        publish(learner, order["job_id"], fake_model_folder(tmp_path / "v1", seed=1), version=1, step=1)
    report(api, work, step=1, published=1)
    sampler = ok(retrieve(client, saved["request_id"]))["sampling_session_id"]
    with api.db.session() as s:
        spec = s.get(Job, order["job_id"]).spec
        assert (spec["partial_rollouts"], spec["staleness"]) == (True, fleet.INFLIGHT_STALENESS)
    _, worker = serving_worker(api, order["job_id"])
    return client, model_id, sampler, order["job_id"], worker


def test_an_inflight_fleet_group_moves_to_the_newer_checkpoint_and_is_audited_per_version(api, tmp_path):
    client, model_id, sampler, job_id, worker = _inflight_model(api, tmp_path)
    request_id = asample(client, sampler)
    leased = lease(worker, job_id)
    saved = ok(client.post("/api/v1/save_weights_for_sampler", json={
        "model_id": model_id, "sampling_session_seq_id": 2, "kind": "inflight"}))
    work = claim(api, holding=[model_id])["work"]
    assert work["request_id"] == saved["request_id"] and work["publish"]["version"] == 2
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {work['publish']['token']}"}) as learner:
        publish(learner, job_id, fake_model_folder(tmp_path / "v2", seed=2), version=2, step=2)
    report(api, work, step=2, published=2)
    # The worker's group continued on version 2 between its segments: its first two tokens are version 1's.
    spanning = {**group(leased["prompts"][0], [([4, 5, 6, 7], "length")] * 2)}
    for sample in spanning["samples"]:
        sample["versions"] = [[1, 2], [2, 2]]
    [result] = submit(worker, leased, [spanning])
    assert result["status"] == "accepted", result
    audit = claim(api, holding=[model_id])["work"]
    assert audit["kind"] == "audit" and audit["payload"]["versions"] == [[1, 1, 2, 2]] * 2
    assert audit["payload"]["checkpoints"] == {"1": "sampler-1", "2": "sampler-2"}  # each token under its own
    report(api, audit, audit={"passed": True})
    assert retrieve(client, request_id).headers["content-type"] == "application/x-protobuf"
    seq = ok(client.get(f"/v1/tinker/sequences/{request_id}:0"))
    assert [(c["checkpoint"], c["tokens"]) for c in seq["checkpoints"]] == [("sampler-1", 2), ("sampler-2", 2)]
    assert seq["drawn_by"].startswith("worker ")


def test_an_inflight_request_not_leased_yet_is_drawn_with_the_newest_weights(api, tmp_path):
    client, model_id, sampler, job_id, worker = _inflight_model(api, tmp_path)
    asample(client, sampler)
    saved = ok(client.post("/api/v1/save_weights_for_sampler", json={
        "model_id": model_id, "sampling_session_seq_id": 2, "kind": "inflight"}))
    work = claim(api, holding=[model_id])["work"]
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {work['publish']['token']}"}) as learner:
        publish(learner, job_id, fake_model_folder(tmp_path / "v2", seed=2), version=2, step=2)
    report(api, work, step=2, published=2)
    ok(retrieve(client, saved["request_id"]))
    with api.db.session() as s:
        assert s.scalar(select(Prompt.version).where(Prompt.job_id == job_id)) == 2
    # A snapshot save of an in-flight model is not published: the fleet job serves one kind.
    snap = ok(client.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id,
                                                                    "sampling_session_seq_id": 3}))
    work = claim(api, holding=[model_id])["work"]
    assert work["request_id"] == snap["request_id"] and work["publish"] is None


def test_the_fleet_job_is_a_job_of_its_own_kind(api, fleet_model):
    _, _, job_id, _, _ = fleet_model
    fleet_jobs = api.admin.get("/v1/jobs", params={"tinker": "true"}).raise_for_status().json()["items"]
    assert [(j["id"], j["kind"]) for j in fleet_jobs] == [(job_id, "tinker_fleet")]
    others = api.admin.get("/v1/jobs", params={"tinker": "false"}).raise_for_status().json()["items"]
    assert job_id not in {j["id"] for j in others} and all(j["kind"] == "grpo" for j in others)


def test_a_trusted_workers_audited_group_is_delivered_as_the_rest_of_its_window_is_then_audited(api, fleet_model):
    """A trusted worker's one audited group of each window waited for the host's audit while the others answered
    their requests at once: sending a group again showed 'accepted' for the pick and 'trained' for the rest (and
    its provider's earnings, a tick later, said the same), so it forged the rest of each window, delivered to the
    Tinker user unaudited (review finding). Every group of a trusted worker is now delivered at once, the pick
    audited after; a failed audit strikes it all the same."""
    client, sampler, job_id, worker_id, worker = fleet_model
    with api.db.session() as s:
        s.get_one(Worker, worker_id).trust = "trusted"  # passed its probation
        s.commit()
    window = api.server.settings.audit_window
    answers, audits = set(), {}
    for _ in range(window):
        request_id = asample(client, sampler)
        leased = lease(worker, job_id)
        body = [group(leased["prompts"][0], [([4, 5, 6, 7], "length"), ([5, 4, 6, 7], "length")])]
        [first] = submit(worker, leased, body)
        [again] = submit(worker, leased, body)
        answers.add((first["status"], again["status"]))
        answer = retrieve(client, request_id)  # answered at once, audited or not: the samples
        assert answer.headers["content-type"] == "application/x-protobuf", answer.text
        work = claim(api, holding=[_model_of(api, job_id)]).get("work")  # (the same one again, unanswered)
        if work:
            audits[work["payload"]["rollout_id"]] = work
    assert answers == {("accepted", "accepted")}
    [(rollout_id, work)] = audits.items()  # one audit in the window
    assert work["kind"] == "audit"
    report(api, work, audit={"passed": False, "reason": "logprob mismatch"})
    with api.db.session() as s:
        assert s.get(Worker, worker_id).trust == "suspect"
        assert s.get(Rollout, rollout_id).reject_kind == "audit_failed"
