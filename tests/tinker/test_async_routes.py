"""The routes of issue 31 over HTTP without the SDK or models, the test playing the learner host: stability records
and stable_reinforce's door, an in-flight request yielding to the model's training between its segments, the
checkpoint life cycle (list, TTL, copy, delete, expiry, a sampler checkpoint ending with its session: gone from the
API and from disk), and the billing call answered from the Tinker ledger. tests/tinker/test_sdk_async.py runs the
same calls with the SDK and a real host."""

from __future__ import annotations

import struct
from datetime import UTC, datetime, timedelta

from sqlalchemy import select, update

from api.tinker.models import TinkerCheckpoint, TinkerRequest, TinkerSequence
from tests.factories import new_user, ok
from tests.tinker.test_routes import (
    _field,
    _tensor,
    _varint,
    claim,
    key_of,
    ready_model,
    report,
    retrieve,
    sdk,
    upload_state,
)

PROTO = {"Content-Type": "application/x-protobuf"}


def sampler_of(api, client, model_id: str, seq: int = 0, kind: str = "snapshot") -> str:
    save = ok(client.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id, "kind": kind,
                                                                     "sampling_session_seq_id": seq}))
    report(api, claim(api, holding=[model_id])["work"], step=0)
    return ok(retrieve(client, save["request_id"]))["sampling_session_id"]


def save_sampler(api, client, model_id: str, name: str) -> str:
    """save_weights_for_sampler under `name`; its tinker:// path."""
    future = ok(client.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id, "path": name}))
    report(api, claim(api, holding=[model_id])["work"], step=1)
    return ok(retrieve(client, future["request_id"]))["path"]


def save_state(api, client, model_id: str, name: str, data: bytes) -> str:
    """save_state under `name`, the test host uploading `data` as its file; its tinker:// path."""
    future = ok(client.post("/api/v1/save_weights", json={"model_id": model_id, "path": name}))
    report(api, claim(api, holding=[model_id])["work"], step=1, state=upload_state(api, data))
    return ok(retrieve(client, future["request_id"]))["path"]


def open_sampler(client, session: str, seq: int, model_path: str):
    return client.post("/api/v1/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": seq,
                                                                "model_path": model_path})


def asample(client, sampler: str, prompt: list[int], n: int = 1, **extra) -> dict:
    body = {"sampling_session_id": sampler, "num_samples": n, "prompt": {"chunks": [{"tokens": prompt}]},
            "sampling_params": {"max_tokens": 3, "stop": []}, **extra}
    return ok(client.post("/api/v1/asample", json=body))


def span(kind: int, sequence_id: str, offset: int, length: int) -> bytes:
    inner = _field(1, sequence_id.encode()) + bytes([2 << 3]) + _varint(offset) + bytes([3 << 3]) + _varint(length)
    return _field(kind, inner)


def stable_body(model_id: str, tokens: list[int], targets: list[int], advantages: list[float], spans: bytes) -> bytes:
    chunk = _field(1, _field(1, b"".join(struct.pack("<i", t) for t in tokens)))
    inputs = {"target_tokens": _tensor(targets, 2), "advantages": _tensor(advantages, 1),
              "logprobs": _tensor([-9.0] * len(targets), 1)}
    datum = _field(1, chunk) + b"".join(_field(2, _field(1, k.encode()) + _field(2, v)) for k, v in inputs.items())
    return _field(1, model_id.encode()) + _field(3, datum + spans) + _field(4, b"stable_reinforce")


def test_stable_reinforce_trains_on_the_recorded_behaviour_named_by_spans(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    sampler = sampler_of(api, client, model_id)
    future = asample(client, sampler, [1, 2, 3], record_stability_info=True)
    plain = asample(client, sampler, [1, 2, 3])
    reply = claim(api, holding=[model_id])
    recorded = {"tokens": [7, 8, 9], "logprobs": [-0.25, -1.5, -3.0], "stop_reason": "length"}
    for work in (reply["work"], *reply["more"]):
        report(api, work, sample={"sequences": [recorded]})
    seq_id, plain_id = future["sample_sequence_ids"][0], plain["sample_sequence_ids"][0]
    with api.db.session() as db:
        assert db.get(TinkerSequence, seq_id).logprobs == [-0.25, -1.5, -3.0]
        assert db.get(TinkerSequence, plain_id) is None  # not asked for: not recorded

    # rl_loop's datum: input = prompt + sampled[:-1]; targets = prompt[1:] + sampled.
    tokens, targets, adv = [1, 2, 3, 7, 8], [2, 3, 7, 8, 9], [0.0, 0.0, 1.0, 1.0, 1.0]
    spans = (_field(3, span(1, seq_id, 0, 3)) + _field(3, span(2, seq_id, 0, 2))
             + _field(4, span(1, seq_id, 1, 2)) + _field(4, span(2, seq_id, 0, 3)))
    queued = ok(client.post("/api/v1/forward_backward", headers=PROTO,
                            content=stable_body(model_id, tokens, targets, adv, spans)))
    work = claim(api, holding=[model_id])["work"]
    assert work["request_id"] == queued["request_id"]
    assert work["payload"]["data"][0]["inputs"]["recorded_logprobs"] == [0.0, 0.0, -0.25, -1.5, -3.0]

    def refused(body: bytes) -> str:
        answer = client.post("/api/v1/forward_backward", headers=PROTO, content=body)
        assert answer.status_code == 400, answer.text
        return answer.json()["detail"]

    assert "needs provenance spans" in refused(stable_body(model_id, tokens, targets, adv, b""))
    forged = [2, 3, 7, 8, 10]
    assert "are not the sampled tokens of sequence" in refused(stable_body(model_id, tokens, forged, adv, spans))
    on_prompt = [1.0, 0.0, 1.0, 1.0, 1.0]
    assert "advantages must be 0 on prompt positions" in refused(stable_body(model_id, tokens, targets, on_prompt,
                                                                              spans))
    unrecorded = (_field(3, span(1, plain_id, 0, 3)) + _field(3, span(2, plain_id, 0, 2))
                  + _field(4, span(1, plain_id, 1, 2)) + _field(4, span(2, plain_id, 0, 3)))
    assert "is not recorded" in refused(stable_body(model_id, tokens, targets, adv, unrecorded))
    short = _field(3, span(1, seq_id, 0, 3)) + _field(4, span(1, seq_id, 1, 2))
    assert "cover 3 positions, but the field has 5" in refused(stable_body(model_id, tokens, targets, adv, short))
    _, bob = new_user(api, "bob")
    b_client = sdk(api, key_of(bob))
    _, b_model = ready_model(api, b_client)
    answer = b_client.post("/api/v1/forward_backward", headers=PROTO,
                           content=stable_body(b_model, tokens, targets, adv, spans))
    assert answer.status_code == 400 and "is not recorded" in answer.json()["detail"]  # Alice's record, not Bob's
    record = ok(client.get(f"/v1/tinker/sequences/{seq_id}"))
    assert [(c["checkpoint"], c["tokens"]) for c in record["checkpoints"]] == [("sampler-0", 3)]
    assert record["drawn_by"] == "learner host" and record["recorded_until"]


def test_an_inflight_request_runs_a_segment_then_gives_way_to_the_training_sent_after_it(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    sampler = sampler_of(api, client, model_id, kind="inflight")
    future = asample(client, sampler, [1, 2])
    step = ok(client.post("/api/v1/optim_step", json={"model_id": model_id, "adam_params": {"learning_rate": 0.1}}))
    work = claim(api, holding=[model_id])["work"]
    assert work["request_id"] == future["request_id"] and work["payload"]["inflight"] is True
    progress = {"rows": [[[5, 6], [-0.5, -0.5], [["sampler-0", 2]], False, False]], "seed": 7}
    report(api, work, progress=progress, seconds=0.5)
    assert retrieve(client, future["request_id"]).json()["type"] == "try_again"
    training = claim(api, holding=[model_id])["work"]
    assert training["request_id"] == step["request_id"]  # the training sent after it runs first
    report(api, training, metrics={"step": 1.0})
    again = claim(api, holding=[model_id])["work"]
    assert again["request_id"] == future["request_id"] and again["payload"]["progress"]["rows"][0][0] == [5, 6]
    assert again["payload"]["progress"]["seconds"] == 0.5
    done = {"tokens": [5, 6, 9], "logprobs": [-0.5, -0.5, -1.0], "stop_reason": "length",
            "checkpoints": [["sampler-0", 2], ["sampler-1", 1]]}
    report(api, again, sample={"sequences": [done]}, seconds=0.25)
    assert retrieve(client, future["request_id"]).headers["content-type"] == "application/x-protobuf"
    record = ok(client.get(f"/v1/tinker/sequences/{future['sample_sequence_ids'][0]}"))
    assert [(c["checkpoint"], c["tokens"]) for c in record["checkpoints"]] == [("sampler-0", 2), ("sampler-1", 1)]
    bill = ok(alice.get("/v1/tinker/usage"))
    [entry] = [e for e in bill["entries"] if e["request_id"] == future["request_id"]]
    assert entry["seconds"] == 0.75  # both segments


def test_checkpoints_are_listed_expire_copy_and_delete_from_the_api_and_the_disk(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    states_dir = api.server.settings.data_dir / "tinker-states"

    def save(name: str, data: bytes, ttl: int | None = None) -> dict:
        body = {"model_id": model_id, "path": name, **({"ttl_seconds": ttl} if ttl else {})}
        future = ok(client.post("/api/v1/save_weights", json=body))
        state = upload_state(api, data)
        report(api, claim(api, holding=[model_id])["work"], step=1, state=state)
        assert ok(retrieve(client, future["request_id"]))["path"] == f"tinker://{model_id}/weights/{name}"
        return state

    keep, scratch = save("keep", b"state one", ttl=7200), save("scratch", b"state two")
    bad = client.post("/api/v1/save_weights", json={"model_id": model_id, "path": "x", "ttl_seconds": 10})
    assert bad.status_code == 400 and "between 3600" in bad.json()["detail"]
    listed = ok(client.get(f"/api/v1/training_runs/{model_id}/checkpoints"))["checkpoints"]
    assert {c["checkpoint_id"]: c["expires_at"] is not None for c in listed} == {"weights/keep": True,
                                                                                 "weights/scratch": False}
    assert {c["size_bytes"] for c in listed} == {9}
    ok(client.put(f"/api/v1/training_runs/{model_id}/checkpoints/weights/scratch/ttl", json={"ttl_seconds": 3600}))
    copy = ok(client.post("/api/v1/copy_weights", json={"source_path": f"tinker://{model_id}/weights/keep",
                                                        "destination_project_id": "p", "ttl_seconds": 3600}))
    assert copy["tinker_path"].endswith("/weights/keep") and copy["tinker_path"] != f"tinker://{model_id}/weights/keep"
    sampler_copy = client.post("/api/v1/copy_weights", json={"source_path": f"tinker://{model_id}/sampler_weights/s",
                                                             "destination_project_id": "p"})
    assert sampler_copy.status_code == 400 and "copies states" in sampler_copy.json()["detail"]

    ok(client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/weights/keep"))
    assert (states_dir / f"{keep['sha256']}.pt").exists()  # the copy still names the file
    user = ok(client.get("/api/v1/checkpoints"))
    assert {c["tinker_path"] for c in user["checkpoints"]} == {f"tinker://{model_id}/weights/scratch",
                                                               copy["tinker_path"]}
    assert user["cursor"]["total_count"] == 2
    run, _, name = copy["tinker_path"].removeprefix("tinker://").partition("/weights/")
    ok(client.delete(f"/api/v1/training_runs/{run}/checkpoints/weights/{name}"))
    assert not (states_dir / f"{keep['sha256']}.pt").exists()  # gone from disk with its last name
    gone = client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/weights/keep")
    assert gone.status_code == 404

    with api.db.session() as db:  # the scratch state's TTL passes: the next host claim removes it
        db.execute(update(TinkerCheckpoint).where(TinkerCheckpoint.name == "scratch")
                   .values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
        db.commit()
    claim(api, holding=[model_id])
    assert ok(client.get(f"/api/v1/training_runs/{model_id}/checkpoints"))["checkpoints"] == []
    assert not (states_dir / f"{scratch['sha256']}.pt").exists()

    sampler_of(api, client, model_id, seq=5)
    ok(client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/sampler-5"))
    work = claim(api, holding=[model_id])["work"]
    assert (work["kind"], work["payload"]) == ("drop_checkpoint", {"name": "sampler-5"})  # the host forgets it


def test_ending_a_session_ends_its_sampler_checkpoints_and_loading_one_says_how_to_keep_weights(api):
    """docs/TINKER.md: a sampler checkpoint lives at most as long as its model (its session), and ending the session
    removes it from the API at once (listing, loading, sampling). After the session that saved it ended (the host
    dropped the model and its weights), it stayed listed with expires_at None, i.e. kept until deleted, and
    create_sampling_client on its listed path was refused with "create a new ServiceClient", which cannot help."""
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    session, model_id = ready_model(api, client)
    path = save_sampler(api, client, model_id, "final")
    later = ok(client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}))["session_id"]
    sampler = ok(open_sampler(client, later, 0, path))["sampling_session_id"]  # opened while its session lives
    ok(client.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "success"}}))
    assert claim(api, holding=[model_id])["drop"] == [model_id]  # the host forgets the model and its weights

    assert path not in {c["tinker_path"] for c in ok(client.get("/api/v1/checkpoints"))["checkpoints"]}
    assert ok(client.get(f"/api/v1/training_runs/{model_id}/checkpoints"))["checkpoints"] == []
    assert ok(client.get(f"/api/v1/training_runs/{model_id}"))["last_sampler_checkpoint"] is None
    assert client.post("/api/v1/weights_info", json={"tinker_path": path}).status_code == 404
    opened = open_sampler(client, later, 1, path)
    assert opened.status_code == 404 and "ended with the session that saved it" in opened.json()["detail"]
    assert "save_state" in opened.json()["detail"] and "ServiceClient" not in opened.json()["detail"]
    drawn = client.post("/api/v1/asample", json={"sampling_session_id": sampler, "num_samples": 1,
                                                 "prompt": {"chunks": [{"tokens": [1, 2]}]},
                                                 "sampling_params": {"max_tokens": 3}})
    assert drawn.status_code == 404 and "save_state" in drawn.json()["detail"], drawn.text


def test_a_state_path_does_not_open_a_sampler_on_the_sampler_checkpoint_of_the_same_name(api):
    """create_sampling_client(model_path=tinker://RUN/weights/NAME): sampling takes sampler weights. A state path
    was accepted whenever a *sampler* checkpoint of the same name existed, and the client then sampled that
    sampler checkpoint's weights, not the state's the user named (here saved 10 steps apart); it must be refused
    as a state path, saying what sampling takes (it was a bare 404 when no sampler checkpoint shared the name)."""
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    session, model_id = ready_model(api, client)
    state = save_state(api, client, model_id, "step10", b"the state of step 10")
    save_sampler(api, client, model_id, "step10")  # later weights, saved under the same name
    opened = open_sampler(client, session, 0, state)
    assert opened.status_code == 400, (opened.status_code, opened.text)
    assert "sampler_weights" in opened.json()["detail"]
    alone = open_sampler(client, session, 1, save_state(api, client, model_id, "step20", b"the state of step 20"))
    assert alone.status_code == 400 and "sampler_weights" in alone.json()["detail"], alone.text


def test_billing_usage_is_the_tinker_ledger_by_hour_and_kind(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    sampler = sampler_of(api, client, model_id)
    future = asample(client, sampler, [1, 2, 3, 4])
    report(api, claim(api, holding=[model_id], price=3.6)["work"], seconds=10.0,
           sample={"sequences": [{"tokens": [5, 6], "logprobs": [-1.0, -1.0], "stop_reason": "length"}]})
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    params = {"starting_on": (hour - timedelta(hours=1)).isoformat(),
              "ending_before": (hour + timedelta(hours=1)).isoformat()}
    events = ok(client.get("/api/v1/billing/usage/events", params=params))["data"]
    by_type = {e["event_info"]["type"]: e for e in events}
    assert by_type["sampling_prefill"]["event_info"]["token_count"] == 4
    assert by_type["sampling_sample"]["event_info"]["token_count"] == 2
    # 10 s at $3.6/h = $0.01, split 4:2 between prefill and sampling.
    assert abs(by_type["sampling_prefill"]["estimated_cost_usd"] - 0.01 * 4 / 6) < 1e-9
    assert abs(by_type["sampling_sample"]["estimated_cost_usd"] - 0.01 * 2 / 6) < 1e-9
    assert {"checkpoint", "training"} <= set(by_type)  # the sampler save, the model's creation
    with api.db.session() as db:
        assert db.scalar(select(TinkerRequest.status).where(TinkerRequest.id == future["request_id"])) == "done"
    odd = client.get("/api/v1/billing/usage/events",
                     params={**params, "starting_on": hour.replace(minute=5).isoformat()})
    assert odd.status_code == 400 and "hour boundaries" in odd.json()["detail"]
