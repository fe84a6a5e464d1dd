"""Activation solver: cost, freshness, hysteresis, churn, multi-job, infeasibility, records."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from itertools import combinations

import pytest

from planner.capacity import JobProfile, WorkerPerf, WorkerProfile, qualify, required_throughput
from planner.decision import Action, Decision, SolverConfig, SolverState
from planner.selection import _can_beat, _greedy, _joint_columns, _milp, _undominated, candidates
from planner.solver import decide


def job(job_id: str = "j1", **kw) -> JobProfile:
    # slack (S − κ + 1)·T_train = 30 s; demand (1 + h)·R/T_train = R/10 with h = 0
    base = dict(rollouts_per_step=100, t_train_s=10.0, staleness=3, publish_period=1, headroom=0.0)
    return JobProfile(job_id=job_id, **{**base, **kw})


def w(wid: str, mu: float, price: float, t_bcast: float = 10.0, t_gen: float = 5.0, **kw) -> WorkerProfile:
    base = dict(vram_gb=24, backends=frozenset({"vllm"}))
    return WorkerProfile(wid, price, mu=mu, t_gen_s=t_gen, t_bcast_s=t_bcast, **{**base, **kw})


def cost(d: Decision, job_id: str = "j1") -> float:
    return next(a.price_per_h for a in d.jobs if a.job_id == job_id)


def line(d: Decision, wid: str) -> str:
    return next(x.line() for x in d.workers if x.worker_id == wid)


def test_milp_beats_greedy_where_greedy_is_strictly_worse():
    # demand 10: greedy takes the two best ratios (a, b: $1.00/h per rollout/s) = $12/h;
    # the single worker c ($1.10/h per rollout/s) covers it alone for $11/h.
    j = job(rollouts_per_step=100)
    ws = [w("a", 6, 6.0), w("b", 6, 6.0), w("c", 10, 11.0)]
    greedy = decide([j], ws, 0.0, config=SolverConfig(method="greedy"))
    exact = decide([j], ws, 0.0, config=SolverConfig(method="milp"))
    assert set(greedy.assignment) == {"a", "b"} and cost(greedy) == pytest.approx(12.0)
    assert set(exact.assignment) == {"c"} and cost(exact) == pytest.approx(11.0)
    assert cost(exact) < cost(greedy)
    assert exact.method == "milp"
    assert line(exact, "c").startswith("activated c: in the minimum-price set meeting throughput and freshness")
    assert line(greedy, "a").startswith("activated a: cheapest per rollout (#1, $1.00/h per rollout/s)")


def test_milp_never_worse_than_greedy_on_random_pools():
    rng = random.Random(1)
    for _ in range(20):
        ws = [w(f"w{i}", rng.uniform(0.1, 2.0), rng.uniform(0.1, 3.0)) for i in range(40)]
        j = job(rollouts_per_step=rng.randint(20, 150))
        greedy = decide([j], ws, 0.0, config=SolverConfig(method="greedy"))
        exact = decide([j], ws, 0.0, config=SolverConfig(method="milp"))
        assert exact.jobs[0].feasible == greedy.jobs[0].feasible
        assert cost(exact) <= cost(greedy) + 1e-9


def small_pools(seed: int, mus: tuple[float, ...], prices: tuple[float, ...]):
    """Pools of 12 workers for one job, some locked by their dwell time: (pairs, demand, greedy's cost, the
    sets that meet the demand, each as its pairs)."""
    rng = random.Random(seed)
    for _ in range(30):
        ws = [w(f"w{i}", rng.choice(mus) * rng.uniform(0.9, 1.1), rng.choice(prices) * rng.uniform(0.9, 1.1))
              for i in range(12)]
        locked = {f"w{i}" for i in range(12) if rng.random() < 0.15}
        state = SolverState(assignment={x: "j1" for x in locked}, activated_at={x: 0.0 for x in locked})
        j = job(rollouts_per_step=rng.randint(20, 100))
        pairs = candidates([j], ws, 1.0, state, SolverConfig()).fresh["j1"]
        demand = required_throughput(j)
        if sum(p.mu for p in pairs) >= demand:
            sets = [c for size in range(len(pairs) + 1) for c in combinations(pairs, size)
                    if all(p in c for p in pairs if p.locked) and sum(p.mu for p in c) >= demand]
            yield pairs, demand, sum(p.cost for p in _greedy(pairs, demand)), sets


def test_reduced_cost_fixing_keeps_every_worker_of_a_set_no_dearer_than_greedy():
    """The columns LP reduced-cost fixing spares the MILP are ones no set costing at most greedy's holds."""
    pruned = 0
    for pairs, demand, upper, sets in small_pools(3, (0.1, 1.0, 2.0), (0.1, 1.5, 3.0)):
        kept = _can_beat(pairs, demand, upper)
        assert all(p in kept for c in sets if sum(p.cost for p in c) <= upper for p in c)
        pruned += len(pairs) - len(kept)
    assert pruned > 0


def test_dominated_workers_leave_the_milp_without_raising_the_cheapest_set():
    """A worker that enough others are at least as cheap and as fast as leaves the MILP; the cheapest set
    costs the same without it (near-identical workers, as on a large fleet)."""
    pruned = 0
    for pairs, _, upper, sets in small_pools(5, (0.5, 1.0), (0.5, 1.0)):
        kept = _undominated(pairs, upper)
        cheapest = min(sum(p.cost for p in c) for c in sets)
        assert min(sum(p.cost for p in c) for c in sets if all(p in kept for p in c)) == cheapest
        pruned += len(pairs) - len(kept)
    assert pruned > 0


def test_the_joint_milps_pruned_columns_keep_its_cheapest_set():
    """Two jobs sharing 10 workers, some locked by their dwell time: the joint MILP over the pruned columns finds
    a set as cheap as the one over every pair (on 10,000 workers the unpruned one ran out its time limit)."""
    rng, pruned, compared = random.Random(7), 0, 0
    config = SolverConfig(time_limit_s=30.0, mip_rel_gap=0.0)
    for _ in range(40):
        ws = [w(f"w{i}", rng.choice((0.5, 1.0, 2.0)) * rng.uniform(0.9, 1.1), rng.choice((0.2, 1.0, 2.5)) *
                rng.uniform(0.9, 1.1)) for i in range(10)]
        locked = {f"w{i}": rng.choice(("a", "b")) for i in range(10) if rng.random() < 0.15}
        state = SolverState(assignment=locked, activated_at={x: 0.0 for x in locked})
        jobs = [job("a", rollouts_per_step=rng.randint(10, 40)), job("b", rollouts_per_step=rng.randint(10, 40))]
        cands = candidates(jobs, ws, 1.0, state, config)
        demands = {j.job_id: required_throughput(j) for j in jobs}
        every = [p for j in jobs for p in cands.fresh[j.job_id]]
        full, _ = _milp(every, demands, config)
        if full is None:
            continue
        columns = _joint_columns(jobs, cands, demands)
        kept, _ = _milp(columns, demands, config)
        assert kept is not None
        assert sum(p.cost for p in kept) <= sum(p.cost for p in full) + 1e-6
        pruned, compared = pruned + len(every) - len(columns), compared + 1
    assert compared >= 20 and pruned > 0


def test_freshness_excludes_the_cheapest_worker_when_its_broadcast_is_slow():
    j = job(rollouts_per_step=20)  # demand 2, slack 30 s
    ws = [w("w9", 10, 0.10, t_bcast=36.0, t_gen=5.0), w("w1", 1, 1.0), w("w2", 1, 1.1), w("w3", 1, 1.2)]
    d = decide([j], ws, 0.0)
    assert set(d.assignment) == {"w1", "w2"}
    assert line(d, "w9") == "skipped w9: T_bcast+T_gen 41.0s > slack 30.0s"
    assert line(d, "w3") == "idle w3: qualifies but not needed (rule met by cheaper workers)"


def test_hard_constraints_are_explained():
    j = job(rollouts_per_step=10, vram_need_gb=40, backends=frozenset({"vllm"}))
    ws = [
        w("ok", 1, 1.0, vram_gb=80),
        w("small", 1, 0.1, vram_gb=24),
        w("hf", 1, 0.1, vram_gb=80, backends=frozenset({"transformers"})),
        w("dead", 1, 0.1, vram_gb=80, alive=False),
    ]
    d = decide([j], ws, 0.0)
    assert d.assignment == {"ok": "j1"}
    assert line(d, "small") == "skipped small: VRAM 24 GiB < need 40 GiB"
    assert line(d, "hf") == "skipped hf: backend transformers not supported (job needs vllm)"
    assert line(d, "dead") == "skipped dead: not alive"


def noisy(ws: list[WorkerProfile], rng: random.Random, noise: float) -> list[WorkerProfile]:
    return [
        replace(x, mu=x.mu * (1 + rng.uniform(-noise, noise)), t_bcast_s=x.t_bcast_s * (1 + rng.uniform(-noise, noise)))
        for x in ws
    ]


def test_no_flapping_under_small_noise():
    rng = random.Random(7)
    j = job(rollouts_per_step=200)  # demand 20
    pool = [w(f"w{i:02d}", rng.uniform(0.5, 1.5), rng.uniform(0.3, 0.6), t_bcast=rng.uniform(5, 20)) for i in range(60)]
    state, changes, resolves = None, 0, 0
    for tick in range(300):
        d = decide([j], noisy(pool, rng, 0.04), tick * 10.0, state)
        if tick:
            changes += len(d.changes())
            resolves += d.resolved
        state = d.state
    assert changes == 0
    assert resolves == 1  # the end of the first set's dwell time; ±4 % never crosses the 10 % drift threshold


def test_keep_bias_and_dwell_stop_swaps_between_near_equal_workers():
    j = job(rollouts_per_step=10)  # demand 1: one worker of μ 1
    a, b = w("a", 1, 1.00), w("b", 1, 1.01)
    d0 = decide([j], [a, b], 0.0)
    assert d0.assignment == {"a": "j1"}
    state, rng = d0.state, random.Random(3)
    for tick in range(1, 200):
        # ±15 % noise on μ forces re-solves, prices cross by up to 3 %
        pa = replace(a, mu=1.2 * (1 + rng.uniform(-0.15, 0.15)), price_per_h=1.0 + rng.uniform(0, 0.03))
        pb = replace(b, mu=1.2 * (1 + rng.uniform(-0.15, 0.15)), price_per_h=1.0 + rng.uniform(0, 0.03))
        d = decide([j], [pa, pb], tick * 10.0, state)
        assert d.assignment == {"a": "j1"}, d.lines()
        state = d.state


def test_dwell_time_keeps_a_worker_until_it_expires():
    j = job(rollouts_per_step=10)
    cfg = SolverConfig(min_dwell_s=600, keep_bias=0.0)
    d0 = decide([j], [w("old", 1, 1.0)], 0.0, config=cfg)
    # a much cheaper worker joins at t=100: re-solve on churn, but "old" is within its dwell time
    pool = [w("old", 1, 1.0), w("new", 1, 0.2)]
    d1 = decide([j], pool, 100.0, d0.state, cfg)
    assert d1.trigger == "churn: new joined"
    assert d1.assignment == {"old": "j1"}
    assert line(d1, "old") == "kept old: within dwell time (100s < 600s)"
    # nothing changes, nothing re-solves
    assert not decide([j], pool, 300.0, d1.state, cfg).resolved
    # after the dwell time a price change triggers a re-solve that swaps
    d2 = decide([j], [w("old", 1, 0.9), w("new", 1, 0.2)], 700.0, d1.state, cfg)
    assert d2.trigger.startswith("price change: old")
    assert d2.assignment == {"new": "j1"}
    assert line(d2, "old") == "deactivated old: a cheaper set meets the rule without it"


def test_churn_replaces_a_lost_worker():
    j = job(rollouts_per_step=20)  # demand 2
    pool = [w("a", 1, 0.3), w("b", 1, 0.4), w("c", 1, 0.5)]
    d0 = decide([j], pool, 0.0)
    assert set(d0.assignment) == {"a", "b"}
    d1 = decide([j], [replace(pool[0], alive=False), pool[1], pool[2]], 50.0, d0.state)
    assert d1.trigger == "churn: a lost"
    assert set(d1.assignment) == {"b", "c"}
    assert line(d1, "a") == "deactivated a: no longer qualifies: not alive"
    assert line(d1, "c").startswith("activated c:")
    assert d1.jobs[0].feasible


def test_drift_above_ten_percent_triggers_and_freshness_flip_is_explained():
    j = job(rollouts_per_step=20)
    pool = [w("a", 1, 0.3), w("b", 1, 0.4), w("c", 1, 0.5)]
    d0 = decide([j], pool, 0.0)
    assert not decide([j], [replace(pool[0], mu=1.08), *pool[1:]], 10.0, d0.state).resolved
    d_mu = decide([j], [replace(pool[0], mu=0.8), *pool[1:]], 10.0, d0.state)
    assert d_mu.trigger.startswith("drift: a μ 1→0.8")
    # a's broadcast slows by 20 %: its rollouts stay fully admissible, no re-solve ...
    assert not decide([j], [replace(pool[0], t_bcast_s=12.0), *pool[1:]], 10.0, d0.state).resolved
    # ... at 25 s only half of what it makes is still admissible (u = 0.5): the job is short
    d_share = decide([j], [replace(pool[0], t_bcast_s=25.0), *pool[1:]], 10.0, d0.state)
    assert d_share.trigger == "deficit: j1 has 1.50/2.00 rollouts/s (> 10% short)"
    assert d_share.jobs[0].feasible
    # ... and beyond the slack it no longer qualifies at all
    d_fresh = decide([j], [replace(pool[0], t_bcast_s=35.0), *pool[1:]], 10.0, d0.state)
    assert d_fresh.trigger == "drift: a no longer qualifies (T_bcast+T_gen 40.0s > slack 30.0s)"
    assert set(d_fresh.assignment) == {"b", "c"}
    assert line(d_fresh, "a") == "deactivated a: no longer qualifies: T_bcast+T_gen 40.0s > slack 30.0s"


def test_multi_job_priority_and_one_job_per_worker():
    big = job("big", rollouts_per_step=30, priority=1, vram_need_gb=40)  # demand 3, big cards only
    small = job("small", rollouts_per_step=20)  # demand 2, any card
    ws = [w(f"A{i}", 1, 0.8, vram_gb=80) for i in range(4)] + [w(f"R{i}", 1, 0.3) for i in range(3)]
    d = decide([small, big], ws, 0.0)
    by_job: dict[str, set[str]] = {}
    for wid, jid in d.assignment.items():
        by_job.setdefault(jid, set()).add(wid)
    assert len(by_job["big"]) == 3 and all(x.startswith("A") for x in by_job["big"])
    assert len(by_job["small"]) == 2 and all(x.startswith("R") for x in by_job["small"])
    assert [a.job_id for a in d.jobs] == ["big", "small"]  # priority order
    assert all(a.feasible for a in d.jobs)
    assert "joint over 2 jobs" in d.method


def test_multi_job_joint_solution_where_priority_order_alone_would_starve_the_second_job():
    # the first job could use anyone; the second only the big card. Taking the cheapest set for
    # job 1 first would grab the big card; the joint MILP gives it to job 2.
    first = job("first", rollouts_per_step=20, priority=1)
    second = job("second", rollouts_per_step=20, vram_need_gb=40)
    ws = [w("big", 2, 0.5, vram_gb=80), w("r1", 1, 0.4), w("r2", 1, 0.4)]
    d = decide([first, second], ws, 0.0)
    assert d.assignment == {"big": "second", "r1": "first", "r2": "first"}


def test_multi_job_infeasible_falls_back_to_priority_order_with_best_partial_set():
    first = job("first", rollouts_per_step=20, priority=1)  # demand 2
    second = job("second", rollouts_per_step=30)  # demand 3
    ws = [w(f"r{i}", 1, 0.4) for i in range(4)]
    d = decide([first, second], ws, 0.0)
    alloc = {a.job_id: a for a in d.jobs}
    assert alloc["first"].feasible and len(alloc["first"].worker_ids) == 2
    assert not alloc["second"].feasible and len(alloc["second"].worker_ids) == 2
    assert alloc["second"].reason.startswith("infeasible: qualifying throughput 2.00 rollouts/s < needed 3.00")


def test_jobs_of_equal_priority_share_a_fleet_too_small_for_both():
    first = job("first", rollouts_per_step=100, submitted_at=1.0)  # demand 10: more than the whole fleet
    second = job("second", rollouts_per_step=50, submitted_at=2.0)  # demand 5
    ws = [w(f"r{i}", 1, 0.4) for i in range(6)]
    d = decide([first, second], ws, 0.0)
    alloc = {a.job_id: a for a in d.jobs}
    # by the share of need met: 4/10 and 2/5, not all six to the older job
    assert (len(alloc["first"].worker_ids), len(alloc["second"].worker_ids)) == (4, 2)
    assert not alloc["first"].feasible and not alloc["second"].feasible
    assert "fair share: 2 jobs of equal priority" in d.method
    assert "its fair share of a fleet too small for every job" in line(d, alloc["second"].worker_ids[0])
    others = next(x.others for x in d.workers if x.worker_id == alloc["second"].worker_ids[0])
    assert others == (("first", Action.SKIP, "serves job second (one job at a time)"),)


def test_a_job_whose_slack_no_worker_meets_still_gets_its_share_of_near_misses():
    quick = job("quick", rollouts_per_step=10, t_train_s=1.0, submitted_at=1.0)  # slack 3 s: every worker misses
    slow = job("slow", rollouts_per_step=100, submitted_at=2.0)  # slack 30 s: every worker qualifies
    d = decide([quick, slow], [w(f"r{i}", 1, 0.4) for i in range(4)], 0.0)
    alloc = {a.job_id: a for a in d.jobs}
    assert (len(alloc["quick"].worker_ids), len(alloc["slow"].worker_ids)) == (2, 2)
    assert line(d, alloc["quick"].worker_ids[0]).endswith("best effort, closest to fresh: T_bcast+T_gen 15.0s > "
                                                            "slack 3.0s")


def test_a_job_that_starts_later_gets_its_share_once_the_first_jobs_dwell_ends():
    first = job("first", rollouts_per_step=100, submitted_at=1.0)
    ws = [w(f"r{i}", 1, 0.4) for i in range(4)]
    config = SolverConfig(min_dwell_s=60.0)
    d = decide([first], ws, 0.0, config=config)
    assert len(d.assignment) == 4  # alone, the first job takes the whole fleet
    second = job("second", rollouts_per_step=100, submitted_at=2.0)
    d = decide([first, second], ws, 10.0, d.state, config)
    assert set(d.assignment.values()) == {"first"}  # every worker is still within its dwell time
    assert decide([first, second], ws, 30.0, d.state, config).trigger == "none: inputs within tolerance"
    d = decide([first, second], ws, 61.0, d.state, config)
    assert d.trigger == "dwell over: r0 may move to a job that is short"
    assert sorted(d.assignment.values()) == ["first", "first", "second", "second"]


def volunteers(n: int) -> list[WorkerProfile]:
    """$0/h workers (the price a worker registers with by default) of 0.4 groups/s."""
    return [WorkerProfile(f"w{i}", price_per_h=0.0, vram_gb=80, backends=frozenset({"hf"}), mu=0.4, t_gen_s=1.0,
                          t_bcast_s=0.0) for i in range(n)]


def volunteer_job(job_id: str, submitted_at: float = 0.0) -> JobProfile:
    # (1 + 0.1) * 2 / 2 s = 1.1 groups/s: three workers of 0.4 groups/s meet it, two do not
    return JobProfile(job_id, rollouts_per_step=2, t_train_s=2.0, staleness=2, submitted_at=submitted_at)


def test_milp_activates_no_free_worker_the_rule_does_not_need():
    """Eight $0/h workers of 0.4 groups/s, a job needing 1.1 groups/s: three are needed. Every set costs $0, so
    HiGHS returned whichever feasible set it found first (seven); the MILP now drops the workers its set meets the
    rule without, as greedy does. Extra workers take leases and lease room the job does not need."""
    j, workers = volunteer_job("j"), volunteers(8)
    by_id = {x.worker_id: x for x in workers}
    greedy = decide([j], workers, now=0.0, config=SolverConfig(method="greedy")).jobs[0]
    milp = decide([j], workers, now=0.0, config=SolverConfig(method="milp")).jobs[0]
    need = required_throughput(j)
    redundant = [x for x in milp.worker_ids
                 if sum(qualify(by_id[o], j).mu for o in milp.worker_ids if o != x) >= need]
    assert len(greedy.worker_ids) == 3
    assert not redundant and len(milp.worker_ids) == len(greedy.worker_ids), (
        f"MILP activated {len(milp.worker_ids)} workers ({milp.throughput:.1f} groups/s) for a need of {need:.1f}; "
        f"greedy activated {len(greedy.worker_ids)}; {len(redundant)} of the MILP's are redundant")


def test_a_later_job_is_not_starved_by_free_workers_an_earlier_job_does_not_need():
    """Six $0/h workers (2.4 groups/s) and two equal-priority jobs each needing 1.1 groups/s: the fleet meets both.
    Job a, alone first, got five workers (three needed) from the MILP, held on a by their dwell time when job b
    arrived 10 s later: b got the one left and was reported 'its fair share of a fleet too small for every job'."""
    a, b, workers = volunteer_job("a", 0.0), volunteer_job("b", 1.0), volunteers(6)
    first = decide([a], workers, now=0.0)
    later = decide([a, b], workers, now=10.0, state=first.state)
    alloc = {x.job_id: x for x in later.jobs}
    assert alloc["b"].feasible, (
        f"job b got {alloc['b'].worker_ids} ({alloc['b'].throughput:.1f} of {alloc['b'].required:.1f} groups/s) "
        f"while job a holds {alloc['a'].worker_ids} ({alloc['a'].throughput:.1f} of {alloc['a'].required:.1f}); "
        f"b: {alloc['b'].reason}")


def test_a_kept_set_of_free_workers_sheds_those_its_rule_does_not_need():
    """A set of seven $0/h workers where three meet the rule (as the MILP chose before it dropped redundant
    workers) costs no more than the LP bound, $0: the keep shortcut kept all seven at every re-solve."""
    j, workers = volunteer_job("j"), volunteers(8)
    bloated = {f"w{i}": "j" for i in range(7)}
    state = SolverState(assignment=bloated, activated_at=dict.fromkeys(bloated, 0.0))
    d = decide([j], workers, now=700.0, state=state)
    assert d.resolved and d.assignment == {"w4": "j", "w5": "j", "w6": "j"}
    assert d.method.startswith("kept current set")
    assert line(d, "w0") == "deactivated w0: a set of fewer workers meets the rule without it"


def test_infeasible_job_gets_best_partial_set_and_a_reason():
    j = job(rollouts_per_step=50, vram_need_gb=16)  # demand 5
    ws = [
        w("a", 1, 0.3),
        w("b", 1, 0.3),
        w("near", 1, 0.1, t_bcast=30.0),  # 35 s: just misses the 30 s slack
        w("far", 1, 0.1, t_bcast=300.0),
        w("tiny", 5, 0.1, vram_gb=8),
    ]
    d = decide([j], ws, 0.0, config=SolverConfig())
    a = d.jobs[0]
    assert not a.feasible
    assert a.reason == (
        "infeasible: qualifying throughput 2.00 rollouts/s < needed 5.00 (R=50, T_train=10s, h=0); "
        "excluded: 1 by VRAM, 2 by freshness; best partial set"
    )
    assert set(a.worker_ids) == {"a", "b", "near", "far"}
    assert line(d, "near") == "activated near: best effort, closest to fresh: T_bcast+T_gen 35.0s > slack 30.0s"
    assert d.method == "partial"


def test_activate_all_baseline_takes_every_live_capable_worker():
    j = job(rollouts_per_step=10, vram_need_gb=16)
    ws = [w("a", 1, 0.3), w("slow", 1, 0.3, t_bcast=100.0), w("small", 1, 0.1, vram_gb=8), w("x", 1, 9.0, alive=False)]
    d = decide([j], ws, 0.0, config=SolverConfig(method="all"))
    assert set(d.assignment) == {"a", "slow"}
    assert line(d, "slow").startswith("activated slow: activate-all baseline, stale-prone:")


def test_tiny_time_limit_still_returns_a_valid_set():
    rng = random.Random(2)
    ws = [w(f"w{i}", rng.uniform(0.1, 2.0), rng.uniform(0.1, 3.0)) for i in range(300)]
    j = job(rollouts_per_step=400)
    d = decide([j], ws, 0.0, config=SolverConfig(time_limit_s=1e-6))
    greedy = decide([j], ws, 0.0, config=SolverConfig(method="greedy"))
    assert d.jobs[0].feasible
    assert d.jobs[0].throughput >= required_throughput(j) - 1e-9
    assert cost(d) <= cost(greedy) + 1e-9


def test_decision_and_state_are_serialisable_and_round_trip():
    j = job(rollouts_per_step=20)
    pool = [w("a", 1, 0.3), w("b", 1, 0.4, perf_by_job={"j1": WorkerPerf(1.0, 5.0, 10.0)}), w("c", 1, 0.5)]
    d0 = decide([j], pool, 0.0)
    text = json.dumps(d0.to_dict())
    assert "activated a" in text
    restored = SolverState.from_dict(json.loads(json.dumps(d0.state.to_dict())))
    d1 = decide([j], pool, 10.0, restored)
    assert not d1.resolved and d1.assignment == d0.assignment
    assert all(x.action == Action.KEEP for x in d1.workers)


def test_job_finished_releases_its_workers():
    j1, j2 = job("j1", rollouts_per_step=10), job("j2", rollouts_per_step=10)
    pool = [w("a", 1, 0.3), w("b", 1, 0.4)]
    d0 = decide([j1, j2], pool, 0.0)
    assert len(d0.assignment) == 2
    d1 = decide([j2], pool, 10.0, d0.state)
    assert d1.trigger == "job set changed: -j1"
    assert set(d1.assignment.values()) == {"j2"} and len(d1.assignment) == 1
    released = [x for x in d1.workers if x.action == Action.DEACTIVATE]
    assert len(released) == 1 and released[0].reason in (
        "job j1 no longer running",
        "a cheaper set meets the rule without it",
    )
