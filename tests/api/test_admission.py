"""The door: what a hostile worker submits is checked against the job and the published model before
anything is stored as trainable — lengths, vocabulary, logprobs, finish reasons — each refusal with
its own reason, counted against the worker, which two strikes quarantine. The completion text shown
to the job's owner is the platform's own decoding of the tokens, never the worker's text."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.factories import activate, new_job, new_provider, new_user, new_worker, ok, publish, start_learner

MAX_NEW = 8


@pytest.fixture
def door(api, tiny_model_dir):
    _, alice = new_user(api)
    job = new_job(alice, grpo={"group_size": 2, "prompts_per_step": 4, "max_new_tokens": MAX_NEW})
    learner = start_learner(api, job["id"])
    publish(learner, job["id"], tiny_model_dir, version=0, step=0)
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 8, "version": 0}), 201)
    return job, alice, wid, worker, lease


def sample(tokens=(5, 6, 0), logprobs=None, finish="stop", text="42"):
    return {"token_ids": list(tokens), "logprobs": list(logprobs or [-4.5] * len(tokens)), "text": text,
            "finish_reason": finish}


def submit(worker, lease, i, samples):
    group = {"prompt_id": lease["prompts"][i]["prompt_id"], "version": 0, "prompt_token_ids": [1, 2, 3],
             "samples": samples}
    return ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))["results"][0]


@pytest.mark.parametrize(("bad", "reason"), [
    (sample(tokens=[5] * 16_000, finish="length"), "max_new_tokens is 8"),
    (sample(tokens=(5, 96, 0)), "outside the vocabulary (size 96)"),
    (sample(logprobs=[-4.5, -1e4, -4.5]), "no sampler draws a token that unlikely"),
    (sample(finish="length"), "finish_reason is length after 3 tokens"),
    (sample(tokens=(5, 6, 7)), "is not a stop token (an end-of-sequence token"),
    # Sampled on past the end-of-sequence token to max_new_tokens: every token an honest draw, but the sampler
    # stops at the first stop token, and the worker would choose where each sample ends.
    (sample(tokens=[5, 0, *[6] * (MAX_NEW - 2)], finish="length"), "goes on past the stop token at position 1"),
    # "Environment" tokens between two model tokens: neither bounded by max_new_tokens nor audited, yet scored.
    ({**sample(tokens=[5, *[7] * 16_000, 0], logprobs=[-4.5] * 16_002), "turns": [1, 16_000, 1]},
     "turns sent, but the job's task is single-turn"),
])
def test_each_invalid_sample_is_refused_with_its_own_reason_and_a_strike(api, door, bad, reason):
    job, alice, wid, worker, lease = door
    result = submit(worker, lease, 0, [sample(), bad])
    assert result["status"] == "rejected" and reason in result["reason"]
    got = ok(api.admin.get(f"/v1/workers/{wid}"))
    assert got["trust"] == "suspect" and reason in got["trust_reason"]
    row = ok(alice.get(f"/v1/jobs/{job['id']}/rollouts"))["items"][0]
    assert row["status"] == "rejected" and row["fault"] == "worker" and row["reject_kind"] == "invalid"
    prompts = ok(alice.get(f"/v1/jobs/{job['id']}/prompts", params={"limit": 200}))["items"]
    assert next(p for p in prompts if p["id"] == result["prompt_id"])["state"] == "available"


def test_completions_shown_are_the_platforms_decoding_not_the_workers_text(api, door, tiny_model_dir):
    job, alice, _, worker, lease = door
    result = submit(worker, lease, 0, [sample(text="the answer is 42"), sample(tokens=(7, 8, 0), text="42")])
    assert result["status"] == "accepted"
    shown = ok(alice.get(f"/v1/jobs/{job['id']}/rollouts"))["items"][0]["completions"]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert shown == [tok.decode([5, 6, 0], skip_special_tokens=True), tok.decode([7, 8, 0], skip_special_tokens=True)]
    assert "42" not in "".join(shown)


def test_two_strikes_quarantine_the_worker_and_discard_what_it_queued(api, door):
    job, alice, wid, worker, lease = door
    assert submit(worker, lease, 0, [sample(), sample()])["status"] == "accepted"
    submit(worker, lease, 1, [sample(), sample(tokens=(5, 96, 0))])
    third = submit(worker, lease, 2, [sample(), sample(finish="length")])
    assert third["status"] == "rejected"
    got = ok(api.admin.get(f"/v1/workers/{wid}"))
    assert got["trust"] == "quarantined" and got["quarantined_until"] and got["job_id"] is None
    assert all(r["status"] == "rejected" for r in ok(alice.get(f"/v1/jobs/{job['id']}/rollouts"))["items"])
    prompts = ok(alice.get(f"/v1/jobs/{job['id']}/prompts", params={"limit": 200}))["items"]
    assert all(p["state"] == "available" for p in prompts)  # nothing lost: every prompt is back in the pool
    refused = worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 2, "version": 0})
    assert refused.status_code == 403 and "quarantined until" in refused.json()["detail"]
    beat = ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={}))
    assert beat["desired"] == "idle" and "quarantined" in beat["notice"]


def test_a_prompt_outside_the_lease_is_a_strike(api, door):
    _, _, wid, worker, lease = door
    group = {"prompt_id": 10**12, "version": 0, "prompt_token_ids": [1], "samples": [sample(), sample()]}
    result = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))["results"][0]
    assert result["status"] == "rejected" and result["rollout_id"] is None
    assert ok(api.admin.get(f"/v1/workers/{wid}"))["trust"] == "suspect"


def test_a_forged_group_on_a_lease_its_worker_released_is_a_strike_and_a_real_one_is_only_late(api, door):
    """Junk sent on a lease the worker gave back was a blameless "lease is released" (no check, no strike): a
    worker could lease, release and answer at will. The door's checks come first; a real late group stays late."""
    job, alice, wid, worker, lease = door
    ok(worker.post(f"/v1/leases/{lease['id']}/release"))
    late = submit(worker, lease, 0, [sample(), sample()])
    assert late["status"] == "rejected" and late["reason"] == "lease is released"
    assert ok(api.admin.get(f"/v1/workers/{wid}"))["trust"] == "probation"
    forged = submit(worker, lease, 1, [sample(tokens=(5, 96, 0)), sample()])
    assert forged["status"] == "rejected" and "outside the vocabulary" in forged["reason"]
    assert ok(api.admin.get(f"/v1/workers/{wid}"))["trust"] == "suspect"
    kinds = {r["prompt_id"]: (r["reject_kind"], r["fault"])
             for r in ok(alice.get(f"/v1/jobs/{job['id']}/rollouts"))["items"]}
    assert kinds[late["prompt_id"]] == ("lease_ended", "late") and kinds[forged["prompt_id"]] == ("invalid", "worker")


def test_prompt_tokens_no_text_could_encode_to_are_refused_with_a_strike(api, door):
    """The door never bounded a text prompt's tokens but by the protocol's 32,768: a worker sent 32,768 junk ids for
    a prompt of a few words, on a lease it released (late, no strike), and each such group was stored in full. A
    prompt encodes to at most a token per byte of its text and context, plus its chat template's own; a strike
    each, as for any invalid group, so a worker stores two such groups before its quarantine."""
    job, alice, wid, worker, lease = door
    ok(worker.post(f"/v1/leases/{lease['id']}/release"))
    group = {"prompt_id": lease["prompts"][0]["prompt_id"], "version": 0, "prompt_token_ids": [1] * 32_768,
             "samples": [sample(), sample()]}
    out = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))["results"][0]
    assert out["status"] == "rejected" and "more than its text and context could encode to" in out["reason"]
    assert ok(api.admin.get(f"/v1/workers/{wid}"))["trust"] == "suspect"


def test_a_sample_cut_at_the_models_context_is_an_honest_length_finish(api, door):
    """A vLLM worker stops a sample where the model's context ends, before max_new_tokens, with finish "length": the
    door called that a forgery and struck the honest worker. The context (512 tokens for the tiny model) is read from
    the published config; a "length" finish at neither max_new_tokens nor the context's end is still refused."""
    job, alice, wid, worker, lease = door
    prompt = [1] * 509  # 3 tokens of room in the context
    cut = {"prompt_id": lease["prompts"][0]["prompt_id"], "version": 0, "prompt_token_ids": prompt,
           "samples": [sample(tokens=(5, 6, 7), finish="length"), sample(tokens=(8, 9, 10), finish="length")]}
    out = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [cut]}))["results"][0]
    assert out["status"] == "accepted", out
    short = {**cut, "prompt_id": lease["prompts"][1]["prompt_id"],
             "samples": [sample(tokens=(5, 6), finish="length"), sample(tokens=(8, 9), finish="length")]}
    out = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [short]}))["results"][0]
    assert out["status"] == "rejected" and "the model's context leaves 3 after the prompt" in out["reason"]


def test_a_sample_longer_than_the_models_context_leaves_is_refused(api, door):
    """No worker generates past the model's context (vLLM stops there, the transformers backend too): a sample that
    does was not generated by the model, and a model with learned positions could not even be trained on it."""
    job, alice, wid, worker, lease = door
    prompt = [1] * 509  # 3 tokens of room in the context
    for i, past in enumerate([sample(tokens=(5, 6, 7, 8, 0)), sample(tokens=[5] * MAX_NEW, finish="length")]):
        group = {"prompt_id": lease["prompts"][i]["prompt_id"], "version": 0, "prompt_token_ids": prompt,
                 "samples": [sample(tokens=(5, 0)), past]}
        out = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))["results"][0]
        assert out["status"] == "rejected" and "the model's context leaves 3 after the prompt" in out["reason"], out
