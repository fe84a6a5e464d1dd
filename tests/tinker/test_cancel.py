"""What one Tinker request may cost: its tokens are bounded at the door, and a request whose session ends
while a learner host runs it stops at the host's next micro-batch (a dead client's 50k-token forward_backward
used to hold the only slot for 11 minutes), its gradients put back."""

from __future__ import annotations

import struct

import pytest
from echo2.protocol.tinker import MAX_REQUEST_TOKENS

from api.tinker.models import TinkerRequest
from learner.tinker import host as tinker_host
from tests.conftest import ADMIN_KEY
from tests.factories import new_user, ok
from tests.tinker.test_routes import _field, _tensor, key_of, sdk

PROTO = {"Content-Type": "application/x-protobuf"}


def fwdbwd(model_id: str, datums: int, length: int) -> bytes:
    """A cross-entropy forward_backward of `datums` datums of `length` tokens each, in the SDK's protobuf."""
    tokens = [1 + i % 50 for i in range(length)]
    chunk = _field(1, _field(1, b"".join(struct.pack("<i", t) for t in tokens)))
    datum = _field(1, chunk) + _field(2, _field(1, b"target_tokens") + _field(2, _tensor(tokens, 2)))
    return _field(1, model_id.encode()) + bytes([2 << 3, 1]) + _field(3, datum) * datums + \
        _field(4, b"cross_entropy")


def created(api, client, host: tinker_host.Host) -> tuple[str, str]:
    """A session and its LoRA model on echo2:tiny, loaded by `host`."""
    session = ok(client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}))["session_id"]
    future = ok(client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                          "base_model": "echo2:tiny", "lora_config": {"rank": 4}}))
    [work] = host.claim(wait_s=0)
    host.report(work.request_id, host.handle(work))
    return session, future["model_id"]


@pytest.fixture
def host(api, tmp_path, monkeypatch) -> tinker_host.Host:
    monkeypatch.setattr(tinker_host, "WATCH_S", 0.05)  # asked often, so the test does not wait
    return tinker_host.Host(api.url, ADMIN_KEY, "h1", 1, tmp_path / "host", "cpu")


def test_a_request_whose_session_ended_stops_on_the_host_and_gives_its_gradients_back(api, host):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    session, model_id = created(api, client, host)
    request_id = ok(client.post("/api/v1/forward_backward", headers=PROTO, content=fwdbwd(model_id, 64, 256)))[
        "request_id"]
    [work] = host.claim(wait_s=0)  # running on the host now
    ok(client.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "error"}}))  # the client died
    result = host.handle(work)
    assert result.error == "cancelled: the control plane no longer waits for this request"
    assert all(p.grad is None for p in host.models[model_id].params)  # as before the request
    host.report(work.request_id, result)  # ignored: the control plane failed it when the session ended
    with api.db.session() as s:
        row = s.get_one(TinkerRequest, request_id)
        assert row.status == "failed" and row.error == "the session ended (error)"


def test_a_forward_backward_over_the_token_bound_is_refused_at_the_door(api, host):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = created(api, client, host)
    datums = MAX_REQUEST_TOKENS // 512 + 1
    refused = client.post("/api/v1/forward_backward", headers=PROTO, content=fwdbwd(model_id, datums, 512))
    assert refused.status_code == 400, refused.text
    assert refused.json()["detail"] == (
        f"data: {datums * 512:,} tokens in one request, more than Echo2 runs at once (65,536): split the batch "
        "into several forward_backward calls (their gradients add up until optim_step)")
    ok(client.post("/api/v1/forward_backward", headers=PROTO, content=fwdbwd(model_id, datums - 1, 512)))
