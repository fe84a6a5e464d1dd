"""A learner host with one slot and two users, over HTTP with the real host process: the idle model is
parked to the host's disk so the other user's can load, and comes back with its state on its next request."""

from __future__ import annotations

import time

import httpx
import pytest

from api.tinker import futures, host
from learner.tinker.host import Host
from tests.factories import new_user, ok


@pytest.fixture
def host_slots() -> int:
    return 1


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(futures, "LONG_POLL_S", 1.0)
    monkeypatch.setattr(host, "PARK_AFTER_S", 0.0)


def tinker_client(api, name: str) -> httpx.Client:
    _, user = new_user(api, name)
    key = user.headers["Authorization"].split()[1]
    return httpx.Client(base_url=api.url, headers={"X-API-Key": f"tml-{key}"}, timeout=30)


def answer(client: httpx.Client, request_id: str, timeout: float = 180) -> httpx.Response:
    """The future's final answer (a sample's is protobuf, the others JSON)."""
    deadline = time.monotonic() + timeout
    while True:
        reply = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert reply.status_code == 200, reply.text
        if "json" not in reply.headers["content-type"] or reply.json().get("type") != "try_again":
            return reply
        assert time.monotonic() < deadline, f"request {request_id} did not finish: {reply.text}"


def result(client: httpx.Client, request_id: str) -> dict:
    body = answer(client, request_id).json()
    assert "error" not in body, body
    return body


def new_model(client: httpx.Client, tiny: str) -> tuple[str, str]:
    session = ok(client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}))["session_id"]
    created = ok(client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                           "base_model": tiny, "lora_config": {"rank": 4}}))
    return session, created["request_id"]


def optim_step(client: httpx.Client, model_id: str) -> float:
    step = ok(client.post("/api/v1/optim_step", json={"model_id": model_id,
                                                      "adam_params": {"learning_rate": 1e-3}}))["request_id"]
    return result(client, step)["metrics"]["step"]


def test_one_slot_two_users_the_idle_model_is_parked_and_restored(api, tinker_host, tiny_model_dir, host_work_dir,
                                                                   tmp_path):
    alice, bob = tinker_client(api, "alice"), tinker_client(api, "bob")
    session_a, created_a = new_model(alice, str(tiny_model_dir))
    model_a = result(alice, created_a)["model_id"]
    assert optim_step(alice, model_a) == 1
    saved = ok(alice.post("/api/v1/save_weights_for_sampler", json={"model_id": model_a, "path": "before-park"}))
    path = result(alice, saved["request_id"])["path"]

    _, created_b = new_model(bob, str(tiny_model_dir))  # the one slot is Alice's: her idle model is parked
    model_b = result(bob, created_b)["model_id"]
    assert optim_step(bob, model_b) == 1
    parked = Host(api.url, "unused", "test-host", 1, host_work_dir, "cpu").parked_path(model_a)
    assert parked.is_file(), "Alice's model was not parked to the host's disk"

    assert optim_step(alice, model_a) == 2  # restored: its optimizer's step count goes on from 1
    assert not parked.exists()  # loaded again: the parked copy is gone
    sampler = ok(alice.post("/api/v1/create_sampling_session", json={"session_id": session_a,
                                                                     "sampling_session_seq_id": 1,
                                                                     "model_path": path}))
    sample = ok(alice.post("/api/v1/asample", json={"sampling_session_id": sampler["sampling_session_id"],
                                                    "num_samples": 1, "prompt": {"chunks": [{"tokens": [5, 6]}]},
                                                    "sampling_params": {"max_tokens": 3, "seed": 1}}))
    sampled = answer(alice, sample["request_id"])  # not an error: the checkpoint came back with the model
    assert sampled.headers["content-type"] == "application/x-protobuf", sampled.text
    log = (tmp_path / "host.log").read_text()
    assert f"parked model {model_a}" in log and f"restored parked model {model_a}" in log
    assert f"parked model {model_b}" in log  # Bob's, idle in turn, made room for Alice's
