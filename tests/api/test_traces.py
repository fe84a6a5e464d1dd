"""Rollout traces over the real API: a group token by token with its version, the worker's logprobs beside the
learner's, the worker's trust, the audit, the rewards and what the group cost."""

from __future__ import annotations

from echo2 import Client
from transformers import AutoTokenizer

from tests.factories import new_user, ok, traced_step


def test_a_trained_group_is_shown_token_by_token(api, tiny_model_dir):
    jid, ids, alice, _ = traced_step(api, tiny_model_dir)

    trace = ok(alice.get(f"/v1/jobs/{jid}/rollouts/{ids[0]}"))
    assert trace["status"] == "trained" and trace["trained_step"] == 0 and trace["version"] == 0
    assert trace["worker"]["name"] == "traced-worker" and trace["worker"]["trust"] == "probation"
    assert trace["audit"] == {"passed": True, "reason": None, "step": 0, "stats": {"tokens": 5.0}}
    first = trace["samples"][0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # the job's, decoded by the platform
    assert first["text"] == tokenizer.decode([72, 15, 33]) and first["reward"] == 1.0
    assert first["finish_reason"] == "length" and trace["samples"][1]["finish_reason"] == "stop"
    assert [t["text"] for t in first["tokens"]] == [tokenizer.decode([i]) for i in (72, 15, 33)]
    assert [t["id"] for t in first["tokens"]] == [72, 15, 33]
    assert trace["samples"][1]["tokens"][-1]["text"] == "<|endoftext|>"  # special tokens shown in a trace
    assert [(t["version"], t["behaviour_logprob"], t["learner_logprob"]) for t in first["tokens"]] == \
        [(0, -0.5, -0.5), (0, -1.0, -0.75), (0, -0.25, -0.25)]
    assert first["max_abs_mismatch"] == 0.25 and trace["samples"][1]["max_abs_mismatch"] == 0.5
    assert trace["reward_mean"] == 0.5
    assert trace["cost_usd"] is not None and trace["cost_usd"] > 0  # its share of the worker's paid entry
    ledger = ok(alice.get(f"/v1/jobs/{jid}/ledger"))
    worker_paid = sum(e["amount_usd"] for e in ledger["entries"] if e["kind"] == "worker")
    assert abs(trace["cost_usd"] * 2 - worker_paid) < 1e-9

    misfit = ok(alice.get(f"/v1/jobs/{jid}/rollouts/{ids[1]}"))
    assert all(t["learner_logprob"] is None for s in misfit["samples"] for t in s["tokens"])
    assert misfit["audit"] is None and misfit["samples"][0]["max_abs_mismatch"] is None

    step = ok(alice.get(f"/v1/jobs/{jid}/traces", params={"step": 0}))
    assert step["total"] == 2 and {t["id"] for t in step["items"]} == set(ids)
    with Client(base_url=api.url, api_key=alice.headers["Authorization"].removeprefix("Bearer ")) as sdk:
        assert sdk.jobs.trace(jid, ids[0]).samples[0].tokens[1].learner_logprob == -0.75
        assert [t.id for t in sdk.jobs.traces(jid, step=0, limit=1).items] == [step["items"][0]["id"]]
    assert ok(alice.get(f"/v1/jobs/{jid}/traces", params={"step": 1}))["total"] == 0

    _, mallory = new_user(api, "mallory")
    assert mallory.get(f"/v1/jobs/{jid}/rollouts/{ids[0]}").status_code == 404
    assert alice.get(f"/v1/jobs/{jid}/rollouts/rol_nope").status_code == 404
