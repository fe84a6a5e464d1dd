"""Rollout traces over the real API: a group token by token with its version, the worker's logprobs beside the
learner's, the worker's trust, the audit, the rewards and what the group cost."""

from __future__ import annotations

from echo2 import Client
from transformers import AutoTokenizer

from api.models import Rollout, Worker
from api.services import trust
from tests.factories import new_job, new_user, ok, traced_step


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


def test_a_clawed_back_groups_trace_does_not_say_it_cost_the_job_money(api, tiny_model_dir):
    """The owner reads a trained group's trace (GET /v1/jobs/{id}/rollouts/{rollout}: "what the group cost its job,
    its share of the ledger entry that paid its worker"). The worker is then quarantined for forging, and its pay
    is reversed by a `clawback` entry: the job's ledger nets that worker to $0.00 and the job's cost drops to the
    learner's alone. The trace must then not go on saying the group cost the job its old share."""
    jid, ids, alice, _ = traced_step(api, tiny_model_dir)
    before = ok(alice.get(f"/v1/jobs/{jid}/rollouts/{ids[0]}"))
    assert before["cost_usd"] is not None and before["cost_usd"] > 0

    with api.db.session() as s:  # two strikes quarantine it (api/services/trust.py): its pay is clawed back
        worker_id = s.get_one(Rollout, ids[0]).worker_id
        worker = s.get_one(Worker, worker_id)
        for _ in range(trust.STRIKES_TO_QUARANTINE):
            trust.strike(s, worker, "forged logprobs", api.server.settings, audited=True)
        s.commit()

    ledger = ok(alice.get(f"/v1/jobs/{jid}/ledger"))
    kinds = {t["key"]: t["amount_usd"] for t in ledger["by_kind"]}
    assert "clawback" in kinds and abs(kinds["worker"] + kinds["clawback"]) < 1e-12  # the worker nets to $0
    assert abs(ledger["cost"]["workers_usd"]) < 1e-12

    after = ok(alice.get(f"/v1/jobs/{jid}/rollouts/{ids[0]}"))
    step = ok(alice.get(f"/v1/jobs/{jid}/traces", params={"step": 0}))
    shown = [after["cost_usd"]] + [t["cost_usd"] for t in step["items"]]
    # What the traces say the job paid for its groups must agree with what the ledger says it paid their worker.
    assert all(c is None or abs(c) < 1e-12 for c in shown), \
        f"traces say the groups cost {shown} while the ledger nets their worker to $0.00 (clawed back)"


def test_a_trace_does_not_name_another_tenants_job_in_its_workers_evidence(api, tiny_model_dir):
    """GET /v1/workers/{id} shows a user a worker's latest evidence (`trust_reason`) with every other tenant's job
    and rollout ids replaced (api/services/tenancy.py): the possession check, for one, strikes a worker with
    "... of job job_<bob's> wrongly". The trace of the owner's own group (GET /v1/jobs/{id}/rollouts/{rollout},
    /traces, and the dashboard's step page, which puts it in the trust badge's title) must read the same."""
    jid, ids, alice, _ = traced_step(api, tiny_model_dir)
    _, bob = new_user(api, "bob")
    bobs = new_job(bob, name="bobs-secret-run")["id"]

    with api.db.session() as s:  # what the possession check writes when the worker lies about Bob's weights
        worker_id = s.get_one(Rollout, ids[0]).worker_id
        worker = s.get_one(Worker, worker_id)
        trust.strike(s, worker, f"answered the possession challenge for version(s) [3] of job {bobs} wrongly: "
                                "it claimed weights it does not hold", api.server.settings)
        s.commit()

    # The worker endpoint keeps Bob's job from Alice...
    seen = ok(alice.get(f"/v1/workers/{worker_id}"))
    assert bobs not in (seen["trust_reason"] or "") and "another job" in seen["trust_reason"]

    # ... and so must the trace of Alice's own group, and the step's traces (the dashboard's step page).
    one = ok(alice.get(f"/v1/jobs/{jid}/rollouts/{ids[0]}"))["worker"]["trust_reason"]
    step = [t["worker"]["trust_reason"] for t in ok(alice.get(f"/v1/jobs/{jid}/traces", params={"step": 0}))["items"]]
    leaked = [r for r in [one, *step] if r and bobs in r]
    assert not leaked, f"Alice's traces name Bob's job {bobs} in the worker's evidence: {leaked}"
    assert one == seen["trust_reason"]
