"""A cheater that picks its worst samples (rewards far below the fleet's)
evades the fleet comparison entirely by handing back ONE prompt of every lease: a lease that did not get a group
for every prompt it held was excluded whole (fbad916), so none of the cheater's groups was ever compared. A worker
is now judged on all its groups, against the others' fair draws (evidence._drawn)."""

from __future__ import annotations

from api.models import Worker
from tests.api.test_audit_gaming import _working
from tests.api.test_fleet_framing import _group, _rewards
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


def _run(api, tmp_path, keep_back: int) -> dict:
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=64, max_steps=1000,
                               num_prompts=800, grpo={"group_size": 2, "prompts_per_step": 12})
    jid = job["id"]
    hid, honest = new_worker(api, new_provider(api, "honest-co")[1], "honest")
    cid, cheat = new_worker(api, new_provider(api, "mallory-co")[1], "worst-picker")
    for wid in (hid, cid):
        activate(api, wid, jid)
        _working(api, wid)
    with api.db.session() as s:
        for wid in (hid, cid):
            s.get_one(Worker, wid).trust = "trusted"
        s.commit()
    reward_of: dict[str, list[float]] = {}
    for step in range(21):
        lease = ok(cheat.post("/v1/leases", json={"job_id": jid, "max_prompts": 8, "version": 0}), 201)
        mine = lease["prompts"][: len(lease["prompts"]) - keep_back]
        out = ok(cheat.post(f"/v1/leases/{lease['id']}/rollouts",
                            json={"groups": [_group(p, 10 * i) for i, p in enumerate(mine)]}))
        for r in out["results"]:
            reward_of[r["rollout_id"]] = [0.0, 0.0]  # it sends its worst samples: every reward 0
        if keep_back:
            ok(cheat.post(f"/v1/leases/{lease['id']}/release"))
        h = ok(honest.post("/v1/leases", json={"job_id": jid, "max_prompts": 12 - len(mine), "version": 0}), 201)
        out = ok(honest.post(f"/v1/leases/{h['id']}/rollouts",
                             json={"groups": [_group(p, 10 * i) for i, p in enumerate(h["prompts"])]}))
        for p, r in zip(h["prompts"], out["results"], strict=True):
            reward_of[r["rollout_id"]] = _rewards(p["prompt_id"])
        claimed = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": step, "max_groups": 64}))["groups"]
        ids = [g["rollout_id"] for g in claimed]
        audits = [{"rollout_id": g["rollout_id"], "passed": True, "stats": {"tokens": 6.0}}
                  for g in claimed if g["audit"]]  # the replay cannot see a picked sample: every audit passes
        report = step_report(step, ids, audits=audits)
        report["rewards"] = [{"rollout_id": i, "rewards": reward_of[i]} for i in ids]
        ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=report))
    return ok(api.admin.get(f"/v1/workers/{cid}"))


def test_control_a_worst_sample_picker_that_sends_whole_leases_is_caught(api, tmp_path):
    got = _run(api, tmp_path, keep_back=0)
    assert got["trust"] == "suspect" and "reward" in got["trust_reason"], got


def test_a_worst_sample_picker_cannot_evade_the_fleet_comparison_by_handing_back_one_prompt_a_lease(api, tmp_path):
    got = _run(api, tmp_path, keep_back=1)
    assert got["trust"] == "suspect", (
        f"a worker whose every reward is 0 (the fleet's ~0.5), 7 groups a lease over 21 steps, stays "
        f"{got['trust']} ({got['trust_reason']!r}): it released one prompt of each lease, so _first_draws dropped "
        f"every group it sent from the comparison")
