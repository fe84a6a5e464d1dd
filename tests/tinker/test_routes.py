"""The Tinker routes over HTTP without the SDK, with the test playing the learner host: who may call, the
errors the SDK shows, the order a model's requests run in, and what happens when a host or a session goes."""

from __future__ import annotations

import asyncio
import hashlib
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from echo2 import Client
from echo2.protocol.tinker import RequestStatus
from sqlalchemy import event, update

from api.services import notices, retention
from api.tinker import futures, host, queueing, sampling
from api.tinker.models import TinkerRequest
from tests.factories import job_spec, new_provider, new_user, new_worker, ok, run_tick

INFO = {"tokenizer_id": "/models/tiny", "arch": "qwen2", "vocab_size": 96, "max_context_length": 512}


@pytest.fixture(autouse=True)
def short_polls(monkeypatch):
    monkeypatch.setattr(futures, "LONG_POLL_S", 0.5)


def sdk(api, token: str) -> httpx.Client:
    return httpx.Client(base_url=api.url, headers={"X-API-Key": f"tml-{token}"}, timeout=30)


def key_of(client: httpx.Client) -> str:
    return client.headers["Authorization"].split()[1]


def claim(api, holding=(), host="h1", price=0.0, slots=2) -> dict:
    body = {"host": host, "slots": slots, "wait_s": 0, "holding": list(holding), "price_per_hour": price}
    return ok(api.admin.post("/v1/tinker/host/claim", json=body))


def report(api, work: dict, host="h1", **result) -> None:
    answer = ok(api.admin.post(f"/v1/tinker/host/requests/{work['request_id']}/result", params={"host": host},
                               json=result))
    assert answer == {"accepted": True}


def retrieve(client: httpx.Client, request_id: str) -> httpx.Response:
    return client.post("/api/v1/retrieve_future", json={"request_id": request_id})


def ready_model(api, client: httpx.Client) -> tuple[str, str]:
    """A session and a LoRA model the test host has loaded."""
    session = ok(client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}))["session_id"]
    future = ok(client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                          "base_model": "echo2:tiny", "lora_config": {"rank": 4}}))
    work = claim(api)["work"]
    assert work["kind"] == "create_model" and work["model"]["lora"]["rank"] == 4
    report(api, work, info=INFO)
    assert ok(retrieve(client, future["request_id"]))["model_id"] == future["model_id"]
    return session, future["model_id"]


def bob_waits_behind_alice(api) -> tuple[httpx.Client, httpx.Client, str, str, dict]:
    """Alice's model loaded on h1, and Bob's new one waiting for a host: (Alice's client, Bob's, Alice's model,
    Bob's session, the future of Bob's create_model)."""
    _, alice = new_user(api)
    _, bob = new_user(api, "bob")
    a_client, b_client = sdk(api, key_of(alice)), sdk(api, key_of(bob))
    _, model_a = ready_model(api, a_client)
    session_b = ok(b_client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}))["session_id"]
    created_b = ok(b_client.post("/api/v1/create_model", json={"session_id": session_b, "model_seq_id": 0,
                                                               "base_model": "echo2:tiny", "lora_config": {"rank": 4}}))
    return a_client, b_client, model_a, session_b, created_b


def optim(client: httpx.Client, model_id: str, lr: float, key: str | None = None) -> dict:
    headers = {"X-Idempotency-Key": key} if key else {}
    return ok(client.post("/api/v1/optim_step", headers=headers,
                          json={"model_id": model_id, "adam_params": {"learning_rate": lr}}))


def test_callers_need_a_tml_prefixed_user_key(api):
    _, alice = new_user(api)
    assert api.client().get("/api/v1/get_server_capabilities").status_code == 401
    plain = httpx.get(f"{api.url}/api/v1/get_server_capabilities", headers={"X-API-Key": key_of(alice)})
    assert plain.status_code == 401 and "tml-" in plain.json()["detail"]
    _, provider = new_provider(api)
    _, worker = new_worker(api, provider)
    assert sdk(api, key_of(worker)).get("/api/v1/get_server_capabilities").status_code == 403
    names = [m["model_name"] for m in ok(sdk(api, key_of(alice)).get("/api/v1/get_server_capabilities"))
             ["supported_models"]]
    assert names == ["echo2:tiny", "echo2:smollm2"]
    assert alice.post("/v1/tinker/host/claim", json={"host": "h"}).status_code == 403  # hosts are admins


def test_unknown_models_and_calls_fail_at_once_with_the_reason(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    session = ok(client.post("/api/v1/create_session", json={"tags": []}))["session_id"]
    bad = client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                    "base_model": "Qwen/Qwen3-8B", "lora_config": {"rank": 4}})
    assert bad.status_code == 400 and "unknown base model 'Qwen/Qwen3-8B'" in bad.json()["detail"]
    other = client.post("/api/v1/publish_weights", json={}, headers={"x-sdk-method": "RestClient.publish_weights"})
    assert other.status_code == 404 and "RestClient.publish_weights" in other.json()["detail"]
    full = client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 1,
                                                     "base_model": "echo2:tiny"})
    assert full.status_code == 400 and "LoRA" in full.json()["detail"]


def test_a_model_runs_its_requests_in_order_and_futures_stay(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    first, second = optim(client, model_id, 0.1), optim(client, model_id, 0.2)
    assert optim(client, model_id, 0.1, key="same")["request_id"] == optim(client, model_id, 0.1, key="same")[
        "request_id"]  # a retried POST is the same future
    assert retrieve(client, first["request_id"]).json()["type"] == "try_again"
    work = claim(api, holding=[model_id])["work"]
    assert work["request_id"] == first["request_id"] and work["payload"]["learning_rate"] == 0.1
    # The reply carrying it was lost: the host asks again, and gets the same request, not the next one.
    assert claim(api, holding=[model_id])["work"]["request_id"] == first["request_id"]
    report(api, work, metrics={"grad_norm": 1.5})
    assert claim(api, holding=[model_id])["work"]["request_id"] == second["request_id"]
    for _ in range(2):  # durable: asked again, the same answer
        assert ok(retrieve(client, first["request_id"])) == {"metrics": {"grad_norm": 1.5}}
    _, bob = new_user(api, "bob")
    assert retrieve(sdk(api, key_of(bob)), first["request_id"]).status_code == 404


def test_a_lost_host_fails_its_models_with_the_reason(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    pending = optim(client, model_id, 0.1)
    assert claim(api, holding=[])["work"] is None  # restarted: it no longer holds the model
    failed = ok(retrieve(client, pending["request_id"]))
    assert failed["category"] == "server" and "restarted" in failed["error"]
    refused = client.post("/api/v1/optim_step", json={"model_id": model_id, "adam_params": {}})
    assert refused.status_code == 400 and "restarted" in refused.json()["detail"]


def test_ending_a_session_fails_its_requests_and_frees_its_models(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    session, model_id = ready_model(api, client)
    pending = optim(client, model_id, 0.1)
    ok(client.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "success"}}))
    assert ok(retrieve(client, pending["request_id"]))["error"] == "the session ended (success)"
    assert claim(api, holding=[model_id])["drop"] == [model_id]
    assert client.post("/api/v1/session_heartbeat", json={"session_id": session}).status_code == 410


def test_an_ended_sessions_results_are_deleted_after_retention_and_asking_says_so(api):
    """Results outlive their session by ECHO2_ARCHIVE_AFTER_H (a client that reconnects still gets them), then
    the retention sweep deletes them: asking answers 410 with the reason, and a live session keeps its own."""
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    session, model_id = ready_model(api, client)
    done = optim(client, model_id, 0.1)
    report(api, claim(api, holding=[model_id])["work"], metrics={"grad_norm": 1.5})
    _, other_model = ready_model(api, client)  # another session of Alice's, still running
    kept = optim(client, other_model, 0.2)
    report(api, claim(api, holding=[model_id, other_model])["work"], metrics={"grad_norm": 2.5})
    state = api.server.app.state

    def sweep(hours: float) -> None:
        settings = api.server.settings.model_copy(update={"archive_after_h": hours})
        asyncio.run(retention.sweep_periodically(api.db, state.blobs, state.checkpoints, settings))

    ok(client.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "success"}}))
    sweep(1.0)  # ended a moment ago: kept
    assert ok(retrieve(client, done["request_id"])) == {"metrics": {"grad_norm": 1.5}}
    sweep(0.0)
    gone = retrieve(client, done["request_id"])
    assert gone.status_code == 410 and "ECHO2_ARCHIVE_AFTER_H" in gone.json()["detail"], gone.text
    assert ok(retrieve(client, kept["request_id"])) == {"metrics": {"grad_norm": 2.5}}
    with api.db.session() as s:
        assert s.get(TinkerRequest, done["request_id"]).status == RequestStatus.done  # the row stays (usage)


def _varint(n: int) -> bytes:
    out = b""
    while n >= 0x80:
        out, n = out + bytes([n & 0x7F | 0x80]), n >> 7
    return out + bytes([n])


def _field(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2]) + _varint(len(payload)) + payload


def _tensor(values: list[float] | list[int], dtype: int) -> bytes:
    raw = b"".join(struct.pack("<f" if dtype == 1 else "<q", v) for v in values)
    return _field(1, raw) + bytes([3 << 3, dtype]) + _field(4, _varint(len(values)))


def _fwdbwd(model_id: str, loss: str, inputs: dict[str, bytes], tokens: tuple[int, ...] = (1, 2, 3)) -> bytes:
    chunk = _field(1, _field(1, b"".join(struct.pack("<i", t) for t in tokens)))
    datum = _field(1, chunk) + b"".join(_field(2, _field(1, k.encode()) + _field(2, v)) for k, v in inputs.items())
    return _field(1, model_id.encode()) + bytes([2 << 3, 1]) + _field(3, datum) + _field(4, loss.encode())


def _config(key: str, value: float) -> bytes:
    """One loss_fn_config entry (a map entry of field 7, its value a double)."""
    return _field(7, _field(1, key.encode()) + _field(2, b"\x09" + struct.pack("<d", value)))


def test_forward_backward_bodies_are_checked_before_they_queue(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    proto = {"Content-Type": "application/x-protobuf"}
    targets = _tensor([2, 3, 4], 2)
    good = client.post("/api/v1/forward_backward", headers=proto,
                       content=_fwdbwd(model_id, "cross_entropy", {"target_tokens": targets}))
    work = claim(api, holding=[model_id])["work"]
    assert work["request_id"] == ok(good)["request_id"]
    assert work["payload"]["data"] == [{"tokens": [1, 2, 3], "target_tokens": [2, 3, 4], "inputs": {}}]
    cases = {
        "not supported by Echo2": _fwdbwd(model_id, "custom", {"target_tokens": targets}),
        "needs logprobs, advantages": _fwdbwd(model_id, "ppo", {"target_tokens": targets}),
        "one value per input token": _fwdbwd(model_id, "cross_entropy", {"target_tokens": _tensor([2, 3], 2)}),
        "vocabulary size 96": _fwdbwd(model_id, "cross_entropy", {"target_tokens": _tensor([2, 3, 400], 2)}),
        "513 tokens, beyond the model's context of 512": _fwdbwd(
            model_id, "cross_entropy", {"target_tokens": _tensor([2] * 513, 2)}, tokens=(1,) * 513),
        "forward_backward body": b"\x0a\xff",
        "ppo reads clip_low_threshold, clip_high_threshold, not beta": _fwdbwd(
            model_id, "ppo", {"target_tokens": targets, "logprobs": _tensor([0, 0, 0], 1),
                              "advantages": _tensor([0, 0, 0], 1)}) + _config("beta", 0.1),
    }
    for reason, body in cases.items():
        answer = client.post("/api/v1/forward_backward", headers=proto, content=body)
        assert answer.status_code == 400 and reason in answer.json()["detail"], (reason, answer.json())
    assert client.post("/api/v1/forward_backward", json={}).status_code == 415


def test_samples_behind_each_other_go_out_as_one_batch(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    save = ok(client.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id,
                                                                     "sampling_session_seq_id": 0}))
    report(api, claim(api, holding=[model_id])["work"], step=0)
    sampler = ok(retrieve(client, save["request_id"]))["sampling_session_id"]

    def asample() -> str:
        body = {"sampling_session_id": sampler, "num_samples": 2, "prompt": {"chunks": [{"tokens": [1, 2]}]},
                "sampling_params": {"max_tokens": 3}}
        answer = ok(client.post("/api/v1/asample", json=body))
        assert answer["sample_sequence_ids"] == [f"{answer['request_id']}:0", f"{answer['request_id']}:1"]
        return answer["request_id"]

    first, second = asample(), asample()
    step = optim(client, model_id, 0.1)["request_id"]
    last = asample()
    reply = claim(api, holding=[model_id])
    assert [w["request_id"] for w in [reply["work"], *reply["more"]]] == [first, second]
    assert all(w["payload"]["checkpoint"] == "sampler-0" for w in reply["more"])
    sequences = [{"tokens": [3], "logprobs": [-0.5], "stop_reason": "stop"}] * 2
    for work in (reply["work"], *reply["more"]):
        report(api, work, sample={"sequences": sequences})
    assert retrieve(client, first).headers["content-type"] == "application/x-protobuf"
    assert claim(api, holding=[model_id])["work"]["request_id"] == step  # the weights change: not in the batch
    assert retrieve(client, last).json()["type"] == "try_again"


def test_requests_a_host_ran_are_billed_at_its_price_and_failed_ones_cost_nothing(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    session, model_id = ready_model(api, client)  # create_model: billed its wall time at price 0
    proto = {"Content-Type": "application/x-protobuf"}
    ok(client.post("/api/v1/forward_backward", headers=proto,
                   content=_fwdbwd(model_id, "cross_entropy", {"target_tokens": _tensor([2, 3, 4], 2)})))
    report(api, claim(api, holding=[model_id], price=36.0)["work"], seconds=2.0,
           forward_backward={"outputs": [], "metrics": {"loss:sum": 1.0}})
    optim(client, model_id, 0.1)
    report(api, claim(api, holding=[model_id], price=36.0)["work"], error="bad input", category="user")
    save = ok(client.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id,
                                                                     "sampling_session_seq_id": 0}))
    report(api, claim(api, holding=[model_id], price=36.0)["work"], step=0, seconds=0.25)
    sampler = ok(retrieve(client, save["request_id"]))["sampling_session_id"]
    ok(client.post("/api/v1/asample", json={"sampling_session_id": sampler, "num_samples": 2,
                                            "prompt": {"chunks": [{"tokens": [1, 2]}]},
                                            "sampling_params": {"max_tokens": 3}}))
    sequences = [{"tokens": [3, 4, 5], "logprobs": [-0.5] * 3, "stop_reason": "length"}] * 2
    report(api, claim(api, holding=[model_id], price=36.0)["work"], sample={"sequences": sequences}, seconds=0.5)

    bill = ok(alice.get("/v1/tinker/usage"))
    kinds = {e["kind"]: e for e in bill["entries"]}
    assert list(kinds) == ["create_model", "forward_backward", "save_weights_for_sampler", "sample"]  # not optim
    assert (kinds["forward_backward"]["tokens"], kinds["forward_backward"]["amount_usd"]) == (3, pytest.approx(0.02))
    assert (kinds["sample"]["tokens"], kinds["sample"]["amount_usd"]) == (2 + 2 * 3, pytest.approx(0.005))
    assert kinds["sample"]["host"] == "h1" and kinds["sample"]["price_per_hour"] == 36.0
    assert kinds["create_model"]["amount_usd"] == 0.0  # claimed at price 0
    assert bill["total_usd"] == pytest.approx(0.02 + 0.0025 + 0.005)
    assert [(t["key"], t["entries"]) for t in bill["by_session"]] == [(session, 4)]
    assert {t["key"] for t in bill["by_model"]} == {model_id}
    assert ok(alice.get("/v1/tinker/usage", params={"limit": 1, "offset": 3}))["next_offset"] is None
    assert ok(alice.get("/v1/tinker/usage", params={"limit": 1}))["next_offset"] == 1
    _, bob = new_user(api, "bob")
    assert ok(bob.get("/v1/tinker/usage"))["total_entries"] == 0
    assert ok(alice.get("/v1/tinker/usage", params={"session_id": "tks_other"}))["entries"] == []
    assert alice.get("/v1/tinker/usage", params={"session_id": "tks\x00"}).status_code == 422
    with Client(api.url, key_of(alice)) as sdk_client:  # the Echo2 SDK reads the same ledger
        assert sdk_client.users.tinker_usage(session_id=session).total_usd == pytest.approx(bill["total_usd"])
    assert "seconds" not in ok(retrieve(client, save["request_id"]))  # the bill is not part of the result


def test_models_on_a_host_take_turns_and_a_users_backlog_is_bounded(api, monkeypatch):
    a_client, b_client, model_a, _, _ = bob_waits_behind_alice(api)
    work = claim(api, holding=[model_a])["work"]
    model_b = work["model_id"]
    report(api, work, info=INFO)
    alice_steps = [optim(a_client, model_a, 0.1)["request_id"] for _ in range(3)]
    bob_step = optim(b_client, model_b, 0.1)["request_id"]
    order = []
    for _ in range(4):
        work = claim(api, holding=[model_a, model_b])["work"]
        order.append(work["request_id"])
        report(api, work, step=1)
    assert order == [alice_steps[0], bob_step, alice_steps[1], alice_steps[2]]  # not all of Alice's first

    monkeypatch.setattr(queueing, "MAX_UNFINISHED", 2)
    optim(a_client, model_a, 0.1)
    optim(a_client, model_a, 0.1)
    refused = a_client.post("/api/v1/optim_step", json={"model_id": model_a, "adam_params": {"learning_rate": 0.1}})
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "5"
    assert "2 of your Tinker requests are not finished yet" in refused.json()["detail"]
    optim(b_client, model_b, 0.1)  # another user's queue is their own


def test_what_one_sample_request_or_batch_may_make_a_host_hold_is_bounded(api, monkeypatch):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)  # INFO: a context of 512 tokens
    save = ok(client.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id,
                                                                     "sampling_session_seq_id": 0}))
    report(api, claim(api, holding=[model_id])["work"], step=0)
    sampler = ok(retrieve(client, save["request_id"]))["sampling_session_id"]

    def asample(num_samples: int, max_tokens: int, tokens: tuple[int, ...] = (1, 2), **params) -> httpx.Response:
        return client.post("/api/v1/asample", json={"sampling_session_id": sampler, "num_samples": num_samples,
                                                    "prompt": {"chunks": [{"tokens": list(tokens)}]},
                                                    "sampling_params": {"max_tokens": max_tokens, **params}})

    # An id the model cannot run would reach a fleet worker, which copies it into its group and is struck.
    vocab = INFO["vocab_size"]
    for outside in (asample(1, 8, tokens=(1, vocab)), asample(1, 8, stop=[vocab + 5])):
        assert outside.status_code == 400 and f"below the vocabulary size {vocab}" in outside.json()["detail"]
    too_long = asample(1, 511)
    assert too_long.status_code == 400 and "beyond the model's context of 512 tokens" in too_long.json()["detail"]
    monkeypatch.setattr(sampling, "MAX_SAMPLE_TOKENS", 100)
    too_big = asample(20, 8)
    assert too_big.status_code == 400 and "is 200, over 100 per request" in too_big.json()["detail"]
    first, second, _ = (ok(asample(4, 8))["request_id"] for _ in range(3))  # 40 token slots each
    monkeypatch.setattr(host, "MAX_SAMPLE_TOKENS", 100)
    reply = claim(api, holding=[model_id])
    assert [w["request_id"] for w in [reply["work"], *reply["more"]]] == [first, second]  # a third: 120 > 100


def test_an_idle_model_gives_its_slot_up_to_one_that_waits_and_comes_back_on_its_next_request(api, monkeypatch):
    a_client, b_client, model_a, session_b, created_b = bob_waits_behind_alice(api)
    one_slot = claim(api, holding=[model_a], slots=1)
    assert one_slot["work"] is None and one_slot["park"] == []  # Alice's model has not been idle long enough
    assert retrieve(b_client, created_b["request_id"]).json()["queue_state"] == "paused_capacity"

    monkeypatch.setattr(host, "PARK_AFTER_S", 0.0)
    assert claim(api, holding=[model_a], slots=1)["park"] == [model_a]
    # The reply was lost: the host still holds it, and is asked again (not told to drop it).
    again = claim(api, holding=[model_a], slots=1)
    assert again["park"] == [model_a] and again["drop"] == [] and again["work"]["model_id"] == created_b["model_id"]
    report(api, again["work"], info=INFO)
    model_b = created_b["model_id"]
    assert ok(a_client.post("/api/v1/get_info", json={"model_id": model_a}))["model_id"] == model_a
    step = optim(a_client, model_a, 0.1)
    waiting = retrieve(a_client, step["request_id"]).json()
    assert waiting["queue_state"] == "paused_capacity" and "parked" in waiting["queue_state_reason"]
    swap = claim(api, holding=[model_b], slots=1)
    assert swap["park"] == [model_b]  # Bob's idle model makes room for Alice's, which comes back at once
    back = swap["work"]
    assert back["request_id"] == step["request_id"] and back["restore"] is True
    report(api, back, metrics={"grad_norm": 1.0})
    assert ok(retrieve(a_client, step["request_id"])) == {"metrics": {"grad_norm": 1.0}}
    assert claim(api, holding=[model_a], slots=1)["park"] == []  # nobody waits: Bob's parked model has no request

    ok(b_client.post(f"/api/v1/sessions/{session_b}/finish", json={"reason": {"type": "success"}}))
    assert claim(api, holding=[model_a], slots=1)["drop"] == [model_b]  # its parked state is deleted
    assert claim(api, holding=[model_a], slots=1)["drop"] == []  # once


def test_a_host_gone_mid_poll_is_given_nothing(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    body = {"host": "gone", "slots": 2, "wait_s": 20, "holding": [], "price_per_hour": 0.0}
    with pytest.raises(httpx.ReadTimeout):  # the host dies while its claim waits
        api.admin.post("/v1/tinker/host/claim", json=body, timeout=1.0)
    session = ok(client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}))["session_id"]
    created = ok(client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                           "base_model": "echo2:tiny", "lora_config": {"rank": 4}}))
    work = claim(api)["work"]  # a live host gets the new model, not the dead one's abandoned claim
    assert work is not None and work["model_id"] == created["model_id"]


def test_two_busy_models_of_one_slot_take_turns(api, monkeypatch):
    a_client, b_client, model_a, session_b, created_b = bob_waits_behind_alice(api)
    alice_steps = [optim(a_client, model_a, 0.1)["request_id"] for _ in range(3)]
    work = claim(api, holding=[model_a], slots=1)["work"]  # Alice's model took its slot just now: hers still
    assert work["request_id"] == alice_steps[0]
    report(api, work, metrics={})

    monkeypatch.setattr(host, "SLICE_S", 0.0)  # her slice is over: Bob's model waits, hers is busy
    turn = claim(api, holding=[model_a], slots=1)
    assert turn["park"] == [model_a] and turn["work"]["model_id"] == created_b["model_id"]
    report(api, turn["work"], info=INFO)
    bob_step = optim(b_client, created_b["model_id"], 0.1)["request_id"]
    back = claim(api, holding=[created_b["model_id"]], slots=1)  # Bob's slice is over too; Alice's requests wait
    assert back["park"] == [created_b["model_id"]]
    assert back["work"]["request_id"] == alice_steps[1] and back["work"]["restore"] is True
    report(api, back["work"], metrics={})
    assert retrieve(b_client, bob_step).json()["queue_state"] == "paused_capacity"


def upload_state(api, data: bytes, chunk: int = 5) -> dict:
    """What a host does after save_state: the file in chunks, then the commit (api/tinker/states.py)."""
    digest = hashlib.sha256(data).hexdigest()
    parts = [data[i:i + chunk] for i in range(0, len(data), chunk)]
    for index, part in enumerate(parts):
        answer = api.admin.put(f"/v1/tinker/host/states/{digest}/chunks/{index}", content=part,
                               headers={"X-Echo2-Sha256": hashlib.sha256(part).hexdigest(),
                                        "Content-Type": "application/octet-stream"})
        assert answer.status_code == 204, answer.text
    return ok(api.admin.post(f"/v1/tinker/host/states/{digest}", json={"chunks": len(parts)}), 201)


def test_a_saved_state_is_stored_by_the_control_plane_and_loads_on_any_host(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    session, model_id = ready_model(api, client)
    saved = ok(client.post("/api/v1/save_weights", json={"model_id": model_id, "path": "ckpt"}))
    work = claim(api, holding=[model_id])["work"]
    state = upload_state(api, b"adapter and optimizer state")
    report(api, work, step=3, state=state)
    path = ok(retrieve(client, saved["request_id"]))["path"]
    assert path == f"tinker://{model_id}/weights/ckpt"
    ok(client.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "success"}}))  # it outlives this

    later = ok(client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}))["session_id"]
    body = {"session_id": later, "model_seq_id": 0, "path": path, "optimizer": True}
    created = ok(client.post("/api/v1/load_weights", json=body))
    work = claim(api, host="h2")["work"]  # another host than the one that saved it
    assert work["kind"] == "create_model" and work["model"]["lora"]["rank"] == 4
    assert work["payload"] == {"load": {"model_id": model_id, "name": "ckpt", "optimizer": True,
                                        "sha256": state["sha256"]}}
    download = api.admin.get(f"/v1/tinker/host/states/{state['sha256']}")
    assert download.content == b"adapter and optimizer state"
    report(api, work, host="h2", info=INFO)
    assert ok(retrieve(client, created["request_id"])) == {"type": "load_weights", "model_id": created["model_id"],
                                                           "path": path}

    _, bob = new_user(api, "bob")
    b_client = sdk(api, key_of(bob))
    b_session = ok(b_client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}))["session_id"]
    stolen = b_client.post("/api/v1/load_weights", json={**body, "session_id": b_session})
    assert stolen.status_code == 404 and "no state saved with save_state" in stolen.json()["detail"]
    sampler_path = client.post("/api/v1/load_weights", json={**body, "path": f"tinker://{model_id}/sampler_weights/x"})
    assert sampler_path.status_code == 400 and "tinker://MODEL/weights/NAME" in sampler_path.json()["detail"]
    assert sdk(api, key_of(bob)).get(f"/v1/tinker/host/states/{state['sha256']}").status_code in (401, 403)
    bad = api.admin.post(f"/v1/tinker/host/states/{'0' * 64}", json={"chunks": 1})
    assert bad.status_code == 409 and "not uploaded" in bad.json()["detail"]


def test_malformed_forward_backward_bodies_are_refused_and_strangers_are_not_heard(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    tokens = _field(1, _field(1, _field(1, b"".join(struct.pack("<i", t) for t in (1, 2, 3)))))
    huge_shape = bytes([3 << 3, 1]) + _field(4, _varint(2**32) + _varint(2**32))  # np.prod of it wraps to 0
    head = _field(1, model_id.encode()) + _field(4, b"cross_entropy")
    bodies = {
        "out of bounds": head + _field(3, tokens + _field(2, _field(1, b"target_tokens") + _field(2, huge_shape))),
        "must be a double": head + _field(5, _field(1, b"clip") + bytes([2 << 3 | 5]) + b"\x00\x00\x80\x3f"),
        "not 3 bytes": head + _field(7, _field(1, b"clip") + _field(2, _field(1, b"abc"))),
    }
    for reason, body in bodies.items():
        refused = client.post("/api/v1/forward_backward", headers={"Content-Type": "application/x-protobuf"},
                              content=body)
        assert refused.status_code == 400 and reason in refused.json()["detail"], refused.text
    stranger = httpx.post(f"{api.url}/api/v1/forward_backward", content=b"\xff" * 2**20,
                          headers={"X-API-Key": "tml-not-a-key", "Content-Type": "application/x-protobuf"})
    assert stranger.status_code == 401  # told before its body is read


def test_retries_racing_their_first_attempt_get_its_future(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    session, model_id = ready_model(api, client)
    answers: list[httpx.Response] = []

    def race(path: str, body: dict, key: str | None) -> list[httpx.Response]:
        answers.clear()
        barrier = threading.Barrier(4)

        def post() -> None:
            with sdk(api, key_of(alice)) as mine:
                barrier.wait()
                answers.append(mine.post(path, json=body, headers={"X-Idempotency-Key": key} if key else {}))

        threads = [threading.Thread(target=post) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return list(answers)

    for i in range(3):
        same = race("/api/v1/optim_step", {"model_id": model_id, "adam_params": {"learning_rate": 0.1}}, f"k{i}")
        assert [r.status_code for r in same] == [200] * 4
        assert len({r.json()["request_id"] for r in same}) == 1
        create = {"session_id": session, "model_seq_id": 10 + i, "base_model": "echo2:tiny",
                  "lora_config": {"rank": 4}}
        retried = race("/api/v1/create_model", create, f"c{i}")
        assert [r.status_code for r in retried] == [200] * 4 and len({r.json()["request_id"] for r in retried}) == 1
        # Without keys (as the SDK's outer retry sends a new one): one model, created once, every answer its future.
        twins = race("/api/v1/create_model", {**create, "model_seq_id": 20 + i}, None)
        assert [r.status_code for r in twins] == [200] * 4 and len({r.json()["request_id"] for r in twins}) == 1


def test_sessions_are_listed_and_shown_to_their_owner_only(api):
    _, alice = new_user(api)
    _, bob = new_user(api, "bob")
    mine, theirs = sdk(api, key_of(alice)), sdk(api, key_of(bob))
    session, model_id = ready_model(api, mine)
    other = ok(theirs.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}))["session_id"]
    assert ok(mine.get("/api/v1/sessions"))["sessions"] == [session]
    assert ok(theirs.get("/api/v1/sessions", params={"access_scope": "accessible"}))["sessions"] == [other]
    shown = ok(mine.get(f"/api/v1/sessions/{session}"))
    assert shown == {"training_run_ids": [model_id], "sampler_ids": [], "user_metadata": None}
    assert theirs.get(f"/api/v1/sessions/{session}").status_code == 404
    assert mine.get("/api/v1/sessions", params={"limit": 0}).status_code == 422


def test_open_futures_cost_one_query_per_recheck_and_wake_when_they_end_in_another_process(api, monkeypatch):
    """An async RL loop keeps hundreds of futures open: their long polls share one status query per RECHECK_S
    (not a load each), and a request that ends without this process announcing it (through another API
    process: here, a write straight to the database) is answered at the next recheck, not at the poll's end."""
    monkeypatch.setattr(futures, "LONG_POLL_S", 8.0)
    _, user = new_user(api)
    client = sdk(api, key_of(user))
    session = ok(client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}))["session_id"]
    ids = [ok(client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": i,
                                                        "base_model": "echo2:tiny", "lora_config": {"rank": 4}}))
           ["request_id"] for i in range(20)]  # no host: all pending
    statements: list[str] = []
    listener = lambda conn, cursor, statement, *rest: statements.append(statement)  # noqa: E731

    def poll(request_id: str) -> tuple[float, dict]:
        start = time.monotonic()
        with sdk(api, key_of(user)) as own:
            answer = ok(retrieve(own, request_id))
        return time.monotonic() - start, answer

    with ThreadPoolExecutor(len(ids)) as pool:
        polls = [pool.submit(poll, i) for i in ids]
        time.sleep(1.0)  # every poll is waiting
        event.listen(api.db.engine, "before_cursor_execute", listener)
        try:
            with api.db.session() as db:
                db.execute(update(TinkerRequest).where(TinkerRequest.id == ids[0])
                           .values(status=RequestStatus.done, result={}))
                db.commit()
            answers = [p.result() for p in polls]
        finally:
            event.remove(api.db.engine, "before_cursor_execute", listener)
    took, first = answers[0]
    assert first["type"] == "create_model" and took < 1.0 + 2 * notices.RECHECK_S + 1.0, (took, first)
    assert all(a["type"] == "try_again" and t >= futures.LONG_POLL_S - 0.5 for t, a in answers[1:]), answers[1:]
    # While they waited: a few status queries for all 20, not a load of each every RECHECK_S (over 60).
    waiting = [s for s in statements if "tinker_requests" in s]
    assert len(waiting) <= 8 + 2 * len(ids), waiting  # the rechecks, and each future's final load


def test_a_bad_adam_parameter_is_named_as_its_field(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    refused = client.post("/api/v1/optim_step", json={"model_id": model_id, "adam_params": {"learning_rate": -1}})
    assert refused.status_code == 400 and refused.json()["detail"].startswith("adam_params: learning_rate: ")
    assert [e["field"] for e in refused.json()["errors"]] == ["adam_params.learning_rate"]


def test_tinker_spending_counts_toward_the_daily_quota(api):
    """A daily quota ($ in any 24 h) counts Tinker usage with the jobs' ledger: $10 of Tinker against a $1 quota
    pauses the user's GRPO job, and its next Tinker request is a 402 that says why (it counted jobs alone)."""
    alice_id, alice = new_user(api)
    ok(api.admin.put(f"/v1/users/{alice_id}/quotas", json={"max_concurrent_jobs": None, "max_usd_per_day": 1.0}))
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    proto = {"Content-Type": "application/x-protobuf"}
    fwdbwd = _fwdbwd(model_id, "cross_entropy", {"target_tokens": _tensor([2, 3, 4], 2)})
    ok(client.post("/api/v1/forward_backward", headers=proto, content=fwdbwd))
    report(api, claim(api, holding=[model_id], price=3600.0)["work"], seconds=10.0,
           forward_backward={"outputs": [], "metrics": {"loss:sum": 1.0}})
    assert ok(alice.get("/v1/tinker/usage"))["total_usd"] == pytest.approx(10.0)
    refused = client.post("/api/v1/forward_backward", headers=proto, content=fwdbwd)
    assert refused.status_code == 402 and "daily quota of $1.00 is spent ($10.00" in refused.text
    job = ok(alice.post("/v1/jobs", json=job_spec()), 201)
    run_tick(api)
    assert ok(alice.get(f"/v1/jobs/{job['id']}"))["paused_for"] == "quota"


def test_listings_and_usage_events_refuse_what_is_out_of_range_with_a_4xx(api):
    """An offset past int64, or a date whose window or UTC offset leaves the calendar, was a 500."""
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    for path in ("/api/v1/sessions", "/api/v1/checkpoints", "/api/v1/training_runs"):
        assert client.get(path, params={"offset": 2**63}).status_code in (400, 422), path
    def events(start, end):  # type: ignore[no-untyped-def]
        return client.get("/api/v1/billing/usage/events", params={"starting_on": start, "ending_before": end})

    assert ok(events("9999-12-31T22:00:00Z", "9999-12-31T23:00:00Z"))["data"] == []  # 14 days on is past 9999
    before_year_1 = events("0001-01-01T00:00:00+01:00", "0001-01-02T00:00:00Z")
    assert before_year_1.status_code == 400 and "starting_on is out of range" in before_year_1.text


def test_create_model_on_a_folder_that_is_no_model_is_refused_at_once(api, tmp_path):
    """docs/TINKER.md: a bad base model "is a 400 BadRequestError at once". The route checked only that the name was
    absolute: a host then tried to load a folder without config.json, and the user waited ~55 s for an error
    about a tokenizer that never named the folder (review finding). Checked now as a GRPO job's base model is."""
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    session = ok(client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}))["session_id"]
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    for folder in (empty, tmp_path / "no-such-folder"):
        r = client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                      "base_model": str(folder), "lora_config": {"rank": 4}})
        assert r.status_code == 400, f"{folder}: {r.status_code} {r.text[:200]}"
        assert r.json()["errors"][0]["field"] == "base_model" and str(folder) in r.json()["detail"]
