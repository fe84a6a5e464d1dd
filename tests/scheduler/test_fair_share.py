"""A job no worker is fresh enough for must not take, through the fair share, the workers another
tenant's job qualifies for and needs."""

from tests.factories import fake_model_folder, new_provider, new_user, new_worker, ok, run_tick, running_job


def test_a_job_no_worker_is_fresh_for_does_not_take_the_workers_another_job_needs(api, tmp_path):
    """Six workers that make a group in 4 s (T_bcast+T_gen 4 s). Alice's job (S=1, slack 2 s) qualifies none of
    them: each contributes 0 to her rule. Bob's job (S=3, slack 6 s) qualifies all six and needs four (unmeasured
    workers count for 1/4 of its need each). The fleet covers Bob's job; Alice's can only get best-effort workers.
    The scheduler gave Alice 4 and Bob 2, left his job infeasible and told him they were 'its fair share of a
    fleet too small for every job'."""
    _, alice = new_user(api)
    a, _ = running_job(api, alice, fake_model_folder(tmp_path / "a"), staleness=1,
                       grpo={"group_size": 2, "prompts_per_step": 4})
    _, bob = new_user(api, "bob")
    b, _ = running_job(api, bob, fake_model_folder(tmp_path / "b"), staleness=3,
                       grpo={"group_size": 2, "prompts_per_step": 1})
    _, provider = new_provider(api)
    ids = []
    for i in range(6):
        wid, w = new_worker(api, provider, f"w{i}", price_per_hour=1.0, rollouts_per_s=0.25)
        ok(w.post(f"/v1/workers/{wid}/heartbeat", json={}))
        ids.append(wid)
    run_tick(api)
    on = {wid: ok(api.admin.get(f"/v1/workers/{wid}"))["job_id"] for wid in ids}
    on_bob = [w for w, j in on.items() if j == b["id"]]
    lines = ok(bob.get(f"/v1/jobs/{b['id']}/decisions"))
    told = [d["line"] for d in lines if d["action"] == "activated"]
    on_alice = sum(j == a["id"] for j in on.values())
    assert len(on_bob) >= 4, (f"Bob's job got {len(on_bob)} of the 4 workers it needs, Alice's {on_alice} that "
                              f"her rule counts at 0; Bob was told: {told}")
