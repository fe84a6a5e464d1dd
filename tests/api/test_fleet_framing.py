"""A rational cheating provider framing an honest worker through the fleet comparison
(api/services/evidence.py::compare_fleet) without forging anything.

The comparison takes each worker's trained groups' reward against the rest of the job's, per version, and makes a
worker whose rewards are lower by FLEET_Z standard errors a suspect. It assumes every worker gets a fair draw of
the job's prompts. It does not: the attacker generates honestly (every group it sends passes any audit), scores
its own groups (a verifiable task's reward is the worker's to compute: arithmetic, gsm8k with the answer in the
text the model wrote), submits the groups of the prompts it found easy and releases its lease, which gives the
hard ones back to the pool (a blameless release). The released prompts keep their early order key and go to the
next lease: the honest competitor's. After 10 steps the honest worker's rewards are far below the attacker's,
and the honest worker is made a suspect: every group audited, at most 8 prompts out at once (pool.UNJUDGED), one
strike from a quarantine; the attacker keeps its trust and the easy prompts. It can do it again every 10 steps.
Only fair draws count now: a prompt never handed back, on a lease that got a group for every prompt it held
(RELIABILITY attack 31)."""

from __future__ import annotations

import random

from api.models import Worker
from tests.api.test_audit_gaming import _working
from tests.factories import (
    activate,
    fake_model_folder,
    new_provider,
    new_user,
    new_worker,
    ok,
    running_job,
    step_report,
)

R = 8  # prompts a step


def _rewards(prompt_id: int) -> list[float]:
    """What the job's task gives the model's samples on this prompt: some prompts are hard, some easy (the same
    whoever generates them: both workers run the same weights with the same seeds)."""
    p = random.Random(prompt_id).random()
    return [1.0 if p > 0.35 else 0.0, 1.0 if p > 0.65 else 0.0]


def _group(prompt: dict, k0: int) -> dict:
    samples = [{"token_ids": [5 + k0 + k, 6, 7], "logprobs": [-0.5, -1.0, -0.1], "finish_reason": "stop"}
               for k in range(2)]
    return {"prompt_id": prompt["prompt_id"], "version": 0, "prompt_token_ids": [1, 2, 3], "samples": samples}


def test_a_worker_that_keeps_the_easy_prompts_cannot_make_its_honest_competitor_a_suspect(api, tmp_path):
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=64, max_steps=1000,
                               num_prompts=800, grpo={"group_size": 2, "prompts_per_step": R})
    jid = job["id"]
    hid, honest = new_worker(api, new_provider(api, "honest-co")[1], "honest")
    aid, attacker = new_worker(api, new_provider(api, "mallory-co")[1], "skimmer")
    for wid in (hid, aid):
        activate(api, wid, jid)
        _working(api, wid)
    with api.db.session() as s:  # both earned their trust honestly (probation passed)
        for wid in (hid, aid):
            s.get_one(Worker, wid).trust = "trusted"
        s.commit()

    reward_of: dict[str, list[float]] = {}
    sent_by = {hid: 0, aid: 0}
    for step in range(21):
        # The attacker leases first, keeps the prompts its own scoring says are easy, and gives the rest back.
        lease = ok(attacker.post("/v1/leases", json={"job_id": jid, "max_prompts": R, "version": 0}), 201)
        easy = [p for p in lease["prompts"] if sum(_rewards(p["prompt_id"])) == 2.0]
        if easy:
            out = ok(attacker.post(f"/v1/leases/{lease['id']}/rollouts",
                                   json={"groups": [_group(p, 10 * i) for i, p in enumerate(easy)]}))
            assert all(r["status"] == "accepted" for r in out["results"]), out
            sent_by[aid] += len(easy)
            for p, r in zip(easy, out["results"], strict=True):
                reward_of[r["rollout_id"]] = _rewards(p["prompt_id"])
        ok(attacker.post(f"/v1/leases/{lease['id']}/release"))
        need = R - len(easy)
        if need:
            h = ok(honest.post("/v1/leases", json={"job_id": jid, "max_prompts": need, "version": 0}), 201)
            out = ok(honest.post(f"/v1/leases/{h['id']}/rollouts",
                                 json={"groups": [_group(p, 10 * i) for i, p in enumerate(h["prompts"])]}))
            sent_by[hid] += len(h["prompts"])
            for p, r in zip(h["prompts"], out["results"], strict=True):
                reward_of[r["rollout_id"]] = _rewards(p["prompt_id"])
        claimed = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": step, "max_groups": R}))["groups"]
        ids = [g["rollout_id"] for g in claimed]
        audits = [{"rollout_id": g["rollout_id"], "passed": True, "stats": {"tokens": 6.0}}
                  for g in claimed if g["audit"]]  # every group is an honest draw: every audit passes
        report = step_report(step, ids, audits=audits)
        report["rewards"] = [{"rollout_id": i, "rewards": reward_of[i]} for i in ids]
        ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=report))

    got = {wid: ok(api.admin.get(f"/v1/workers/{wid}")) for wid in (hid, aid)}
    assert got[hid]["trust"] == "trusted", (
        f"the honest worker ({sent_by[hid]} honest groups, every audit passed) is {got[hid]['trust']}: "
        f"{got[hid]['trust_reason']}; the attacker who kept the easy prompts ({sent_by[aid]} groups) is "
        f"{got[aid]['trust']}")
