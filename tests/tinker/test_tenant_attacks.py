"""A hostile tenant of the Tinker API (an ordinary user, not an admin): each test mounts what a review found one
could do (docs/RELIABILITY.md, "Found by a hostile tenant of the Tinker API"). The test plays the learner host
(admin claims and reports), as test_routes does."""

from __future__ import annotations

import pytest
from echo2.protocol.tinker import SessionStatus
from sqlalchemy import func, select, update

from api.tinker import futures
from api.tinker.models import TinkerModel, TinkerRequest, TinkerSession
from tests.factories import new_user, ok
from tests.tinker.test_async_routes import asample, sampler_of
from tests.tinker.test_routes import (
    INFO,
    _fwdbwd,
    _tensor,
    claim,
    key_of,
    ready_model,
    report,
    retrieve,
    sdk,
    upload_state,
)

PROTO = {"Content-Type": "application/x-protobuf"}
SESSION = {"tags": [], "sdk_version": "0.38.0"}


@pytest.fixture(autouse=True)
def short_polls(monkeypatch):
    monkeypatch.setattr(futures, "LONG_POLL_S", 0.5)


def saved_state(api, client, model_id: str, name: str, data: bytes, host: str = "h1") -> str:
    """save_state of `model_id` under `name`, the test host uploading `data` as the state's file."""
    future = ok(client.post("/api/v1/save_weights", json={"model_id": model_id, "path": name}))
    work = claim(api, holding=[model_id], host=host)["work"]
    assert work["request_id"] == future["request_id"]
    report(api, work, host=host, step=1, state=upload_state(api, data))
    return ok(retrieve(client, future["request_id"]))["path"]


def create_model(client, session: str, seq: int, key: str | None = None):
    headers = {"X-Idempotency-Key": key} if key else {}
    return client.post("/api/v1/create_model", headers=headers,
                       json={"session_id": session, "model_seq_id": seq, "base_model": "echo2:tiny",
                             "lora_config": {"rank": 4}})


def test_a_reused_idempotency_key_cannot_park_an_orphan_model_in_a_host_slot_forever(api):
    """Alice sends create_model twice (two sessions, or two seq ids) with one X-Idempotency-Key. The second call
    inserted its model, then enqueue() found the first call's future by the key and returned it: the new model had
    no request at all. The host admitted it (the oldest new model), got no work for it, and from then on counted
    it as held: a pending model is never parked, so the slot was Alice's for as long as her session heartbeat, and
    Bob's model was never loaded. Now a key sent with another call is a 400."""
    with api.db.session() as db:  # nothing else waits for a host
        db.execute(update(TinkerSession).values(status=SessionStatus.finished))
        db.commit()
    _, alice = new_user(api)
    _, bob = new_user(api, "bob")
    a_client, b_client = sdk(api, key_of(alice)), sdk(api, key_of(bob))
    first = ok(a_client.post("/api/v1/create_session", json=SESSION))["session_id"]
    ok(create_model(a_client, first, 0, key="k"))
    second = ok(a_client.post("/api/v1/create_session", json=SESSION))["session_id"]
    reused = create_model(a_client, second, 0, key="k")  # was answered with the first call's future
    assert reused.status_code == 400 and "was sent with another call of yours" in reused.json()["detail"]
    ok(a_client.post(f"/api/v1/sessions/{first}/finish", json={"reason": {"type": "success"}}))

    b_session = ok(b_client.post("/api/v1/create_session", json=SESSION))["session_id"]
    b_future = ok(create_model(b_client, b_session, 0))
    works = []
    for _ in range(4):  # a one-slot host asking for work, holding what it was given
        reply = claim(api, host="solo", slots=1, holding=[w["model_id"] for w in works])
        if reply["work"] is not None:
            works.append(reply["work"])
            report(api, reply["work"], host="solo", info=INFO)
    with api.db.session() as db:
        orphan = db.get(TinkerModel, f"{second}:train:0")
        count = select(func.count()).where(TinkerRequest.model_id == f"{second}:train:0")
        held = (orphan.host, orphan.status, db.scalar(count)) if orphan is not None else None
    assert b_future["request_id"] in [w["request_id"] for w in works], (
        f"Bob's create_model was never handed to the free host; Alice's model (host, status, requests): {held}")


def test_create_model_with_a_taken_seq_id_and_a_fresh_key_does_not_recreate_the_live_model(api):
    """service.new_model returned an existing model to any call that carried *an* idempotency key (not the key
    that created it), and create_model then queued a second create_model request on it: the host rebuilt the
    model from scratch (learner/tinker/host.py _session), its trained adapter, optimizer and checkpoints gone.
    A model is created once now (queueing._created)."""
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    session, model_id = ready_model(api, client)
    first = ok(client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                         "base_model": "echo2:tiny", "lora_config": {"rank": 4}}))
    # The same create again with a fresh key (the SDK's outer retry sends one): the first create's future, the model
    # as it is; the same seq id for another model: a 400.
    again = ok(create_model(client, session, 0, key="a-new-call"))
    assert again["request_id"] == first["request_id"]
    assert ok(retrieve(client, again["request_id"]))["model_id"] == model_id
    other = client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                      "base_model": "echo2:tiny", "lora_config": {"rank": 8}})
    assert other.status_code == 400 and "exists already" in other.json()["detail"]
    reply = claim(api, holding=[model_id])
    assert reply["work"] is None or reply["work"]["kind"] != "create_model"


def test_copy_weights_of_two_users_with_one_idempotency_key_do_not_collide(api):
    """copy_weights without session_id named its run `copy_{sha256(key)}` from the key alone: Bob's copy with
    the key Alice used (a fixed key in a script, or one he saw) was refused as 'exists already'."""
    _, alice = new_user(api)
    _, bob = new_user(api, "bob")
    a_client, b_client = sdk(api, key_of(alice)), sdk(api, key_of(bob))
    _, a_model = ready_model(api, a_client)
    a_path = saved_state(api, a_client, a_model, "ckpt", b"alice's adapter state")
    a_copy = ok(a_client.post("/api/v1/copy_weights", headers={"X-Idempotency-Key": "copy-1"},
                              json={"source_path": a_path}))
    _, b_model = ready_model(api, b_client)
    b_path = saved_state(api, b_client, b_model, "ckpt", b"bob's adapter state!")
    b_copy = b_client.post("/api/v1/copy_weights", headers={"X-Idempotency-Key": "copy-1"},
                           json={"source_path": b_path})
    assert b_copy.status_code == 200, (b_copy.status_code, b_copy.text)
    assert b_copy.json()["tinker_path"] != a_copy["tinker_path"]


def test_copies_into_one_session_are_each_a_copy_of_their_own_source(api):
    """copy_weights into a session without model_seq_id always landed on the run `{session}:copy:0`; a second copy
    of another state with the same name found a checkpoint of that name there and answered its path: the caller
    asked for a copy of state Y and was given the copy of state X (and that run's base model is X's)."""
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    session, model_x = ready_model(api, client)
    path_x = saved_state(api, client, model_x, "final", b"XXXXX")  # 5 bytes
    future = ok(create_model(client, session, 1))
    report(api, claim(api, holding=[model_x])["work"], info=INFO)
    model_y = ok(retrieve(client, future["request_id"]))["model_id"]
    path_y = saved_state(api, client, model_y, "final", b"YYYYYYYYYYYYYYYYYYYY")  # 20 bytes
    ok(client.post("/api/v1/copy_weights", json={"source_path": path_x, "session_id": session}))
    copy_y = ok(client.post("/api/v1/copy_weights", json={"source_path": path_y, "session_id": session}))
    run = copy_y["tinker_path"].removeprefix("tinker://").split("/")[0]
    listed = ok(client.get(f"/api/v1/training_runs/{run}/checkpoints"))["checkpoints"]
    [copied] = [c for c in listed if c["tinker_path"] == copy_y["tinker_path"]]
    assert copied["size_bytes"] == 20, "the copy answered for state Y is the copy of state X"


def test_a_sampler_checkpoint_does_not_delete_the_state_saved_under_the_same_name(api):
    """tinker://M/weights/N and tinker://M/sampler_weights/N are two checkpoints to the SDK (tinker-cookbook's
    save_checkpoint(kind="both") saves both under one name every save_every steps), but they shared one row
    (primary key: model, name). The sampler save overwrote the state's row and, its sha256 now None,
    `_saved` collected the state's file: the state the cookbook resumes from was deleted from disk."""
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    state_path = saved_state(api, client, model_id, "000010", b"state to resume from")
    save = ok(client.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id, "path": "000010"}))
    report(api, claim(api, holding=[model_id])["work"], step=1)
    assert ok(retrieve(client, save["request_id"]))["path"] == f"tinker://{model_id}/sampler_weights/000010"
    listed = {c["tinker_path"] for c in ok(client.get(f"/api/v1/training_runs/{model_id}/checkpoints"))["checkpoints"]}
    assert state_path in listed, f"the state {state_path} is gone: {listed}"
    later = ok(client.post("/api/v1/create_session", json=SESSION))["session_id"]
    load = client.post("/api/v1/load_weights", json={"session_id": later, "model_seq_id": 0, "path": state_path})
    assert load.status_code == 200, (load.status_code, load.text)


@pytest.mark.parametrize("index", ["\u00b2", "1" * 5000])
def test_a_sequence_id_with_an_odd_index_is_a_404_not_a_500(api, index):
    """GET /v1/tinker/sequences/{request}:{k} checked k with str.isdigit(), which is true for '²' and for 5,000
    digits, then int(k) raised ValueError: a 500."""
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    sampler = sampler_of(api, client, model_id)
    future = asample(client, sampler, [1, 2, 3])
    answer = client.get(f"/v1/tinker/sequences/{future['request_id']}:{index}")
    assert answer.status_code == 404, (answer.status_code, answer.text[:200])


def test_requests_queued_before_the_quota_was_spent_are_not_run_after_it(api):
    """The daily quota was checked when a request was queued (queueing._check_quota), never when the host claimed
    it: a user just under the quota queued up to 512 requests (each up to 65,536 tokens) and the host ran and
    billed every one of them, far past max_usd_per_day; the user's jobs, by contrast, pause."""
    alice_id, alice = new_user(api)
    ok(api.admin.put(f"/v1/users/{alice_id}/quotas", json={"max_concurrent_jobs": None, "max_usd_per_day": 1.0}))
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    body = _fwdbwd(model_id, "cross_entropy", {"target_tokens": _tensor([2, 3, 4], 2)})
    queued = [ok(client.post("/api/v1/forward_backward", headers=PROTO, content=body))["request_id"]
              for _ in range(3)]
    first = claim(api, holding=[model_id], price=3600.0)["work"]
    assert first["request_id"] == queued[0]
    report(api, first, seconds=10.0, forward_backward={"outputs": [], "metrics": {"loss:sum": 1.0}})
    assert ok(alice.get("/v1/tinker/usage"))["total_usd"] == pytest.approx(10.0)  # $10 against a $1 quota
    nxt = claim(api, holding=[model_id], price=3600.0)["work"]
    assert nxt is None or nxt["request_id"] not in queued, "the host is handed more of an over-quota user's work"
    for request_id in queued[1:]:  # failed, saying why, not left waiting
        failed = ok(retrieve(client, request_id))
        assert failed["category"] == "user" and failed["error"].startswith("your daily quota of $1.00 is spent")


def test_a_copy_run_that_no_host_can_load_refuses_training_calls_instead_of_hanging_them(api):
    """copy_weights makes a training run of kind `copy` (status ready, no host): 'it cannot be trained on'. But
    service.owned_model accepted it, so optim_step, forward_backward, save_weights and load_weights on its id were
    queued; no host ever holds or admits a ready model with no host, so each future answered try_again 'active'
    forever, and each held one of the user's 512 backlog places until the session ended."""
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    session, model_id = ready_model(api, client)
    path = saved_state(api, client, model_id, "ckpt", b"state")
    copy = ok(client.post("/api/v1/copy_weights", json={"source_path": path, "session_id": session}))
    run = copy["tinker_path"].removeprefix("tinker://").split("/")[0]
    step = client.post("/api/v1/optim_step", json={"model_id": run, "adam_params": {"learning_rate": 0.1}})
    assert step.status_code == 400 and "is a copy made by copy_weights" in step.json()["detail"]
    body = _fwdbwd(run, "cross_entropy", {"target_tokens": _tensor([2, 3, 4], 2)})
    assert client.post("/api/v1/forward_backward", headers=PROTO, content=body).status_code == 400
    load = client.post("/api/v1/load_weights", json={"model_id": run, "path": path})
    assert load.status_code == 400
    assert client.post("/api/v1/get_info", json={"model_id": run}).status_code == 200  # reading it is fine
