"""Simulator: scale, utilisation with the rule-provisioned set, churn, admission, relay, scenarios, CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import planner.sim.reconcile as reconcile
import planner.solver as solver
from planner.sim import (
    ScenarioError,
    SimResult,
    Simulation,
    load_scenario,
    scenario_from_dict,
    simulate,
)
from planner.sim.cli import simulate_main
from planner.sim.relay import Peer, broadcast
from planner.sim.state import LEASED, POOL, READY

SCENARIOS = Path(__file__).resolve().parents[2] / "planner" / "sim" / "scenarios"


@pytest.fixture(scope="module")
def hetero() -> SimResult:
    return simulate(load_scenario(SCENARIOS / "hetero_1000.toml"))


@pytest.fixture(scope="module")
def churn() -> SimResult:
    return simulate(load_scenario(SCENARIOS / "churn.toml"))


def test_simulator_drives_the_real_solver():
    assert reconcile.decide is solver.decide


def test_thousand_heterogeneous_workers_finish_well_under_a_minute(hetero: SimResult):
    assert hetero.n_workers == 1000
    assert hetero.runtime_s < 60  # loose: the bench reports the measured figure
    job = hetero.jobs[0]
    assert job.completed and job.steps == 150
    assert job.prompts_lost == 0 and job.prompts_consumed == job.prompts_total


def test_rule_provisioned_set_keeps_learner_busy_and_under_provisioning_does_not(hetero: SimResult):
    provisioned = hetero.jobs[0]
    sc = load_scenario(SCENARIOS / "hetero_1000.toml")
    short = dataclasses.replace(sc.jobs[0], headroom=-0.3)  # the solver provisions 0.7 · R / T_train
    under = simulate(dataclasses.replace(sc, jobs=(short,))).jobs[0]
    assert provisioned.utilisation >= 0.95
    assert under.completed and under.prompts_lost == 0
    assert under.utilisation < 0.80
    assert under.utilisation < provisioned.utilisation - 0.15
    assert under.wall_s > provisioned.wall_s * 1.2


def test_freshness_and_vram_exclusions_are_recorded(hetero: SimResult):
    first = hetero.full_decisions[0]
    lines = first.lines()
    assert any(x.startswith("skipped rtx3080-") and "VRAM 10 GiB < need 20 GiB" in x for x in lines)
    assert any(x.startswith("skipped rtx3090-home-") and "> slack 192.0s" in x for x in lines)
    assert any(x.startswith("activated ") for x in lines)
    assert first.jobs[0].feasible


def test_churn_returns_prompts_within_ttl_plus_heartbeat_and_replaces_workers(churn: SimResult):
    sc = load_scenario(SCENARIOS / "churn.toml")
    job = churn.jobs[0]
    assert job.completed and job.steps == sc.jobs[0].max_steps
    assert job.prompts_lost == 0 and job.prompts_consumed == job.prompts_total
    kill_at = sc.events[0].at_s
    killed = {wid for t, wid in churn.kills if t == kill_at}
    assert len(killed) >= 3
    assert churn.lease_returns, "killed workers held leases"
    for r in churn.lease_returns:
        assert r.worker_id in killed
        assert r.returned_at - r.killed_at <= sc.lease_ttl_s + sc.tick_s
    after = [d for d in churn.full_decisions if d.at > kill_at]
    assert after and after[0].trigger.startswith("churn:")
    assert after[0].at <= kill_at + sc.dead_after_s + sc.tick_s
    deactivated = {c.worker_id for d in after for c in d.changes() if c.action == "deactivated"}
    activated = [c for d in after for c in d.changes() if c.action == "activated"]
    assert killed <= deactivated
    assert len(activated) >= len(killed)
    assert after[0].jobs[0].feasible
    assert job.utilisation > 0.9


def test_stale_groups_are_dropped_and_their_prompts_return():
    sc = load_scenario(SCENARIOS / "churn.toml")
    sim = Simulation(dataclasses.replace(sc, events=()))
    job = sim.jobs[0]
    job.submitted, job.step = True, 10  # S = 3: versions ≥ 7 are admissible at step 10
    r = sc.jobs[0].rollouts_per_step
    for pid in range(r + 5):
        job.move(job.pool.popleft(), POOL, LEASED)
        job.move(pid, LEASED, READY)
        job.queue(6 if pid < 5 else 9, pid)  # five made with version 6: stale
    sim.learner.try_start(job)
    assert job.dropped == 5
    assert list(job.pool)[:5] == [4, 3, 2, 1, 0]  # back at the head of the pool
    assert all(job.state[p] == POOL for p in range(5))
    assert job.busy and job.consumed == r


def test_synchronous_mode_runs_with_the_predicted_idle_learner():
    result = simulate(load_scenario(SCENARIOS / "sync.toml"))
    job = result.jobs[0]
    predicted = result.full_decisions[-1].jobs[0].predicted_utilisation
    assert job.completed and job.prompts_lost == 0 and job.dropped_stale == 0
    assert job.utilisation < 0.6
    assert job.utilisation == pytest.approx(predicted, abs=0.05)


def test_two_jobs_share_the_pool_one_job_per_worker():
    result = simulate(load_scenario(SCENARIOS / "two_jobs.toml"))
    assert all(j.completed and j.prompts_lost == 0 for j in result.jobs)
    assert all(j.utilisation > 0.9 for j in result.jobs)
    for d in result.full_decisions:
        served = [wid for a in d.jobs for wid in a.worker_ids]
        assert len(served) == len(set(served))
    big = next(d for d in result.full_decisions if len(d.jobs) == 2)
    eight_b = next(a for a in big.jobs if a.job_id == "qwen3-8b-code")
    assert not any(w.startswith("rtx4090") for w in eight_b.worker_ids)  # 24 GB < 40 GB


def test_same_seed_same_result(churn: SimResult):
    again = simulate(load_scenario(SCENARIOS / "churn.toml"))
    assert again.cost_total == churn.cost_total
    assert [d.at for d in again.decisions] == [d.at for d in churn.decisions]


def test_relay_tree_and_chain_beat_star_at_scale():
    peers = [Peer(i, 1e9 / 8 * (1 + i % 5), 1e9 / 8 * (1 + i % 3)) for i in range(60)]
    args = dict(model_bytes=8e9, chunk_bytes=16e6, origin_up_Bps=10e9 / 8, fanout=4, hop_latency_s=0.05)
    tree = broadcast(peers, topology="tree", origin_fanout=8, **args)
    chain = broadcast(peers, topology="chain", **args)
    star = broadcast(peers, topology="star", **args)
    assert max(tree.times.values()) < max(star.times.values()) / 4
    assert max(chain.times.values()) < max(star.times.values()) / 4
    assert chain.max_depth == 60 and tree.max_depth <= 4 and star.max_depth == 1
    # nobody beats its own downlink, nor the origin's share under it (10 Gbit/s over 8 children)
    assert all(tree.times[p.key] >= 8e9 / min(p.down_Bps, 10e9 / 8 / 8) for p in peers)
    # star: 60 peers share 10 Gbit/s: ≈ 384 s each
    share = 10e9 / 8 / 60
    assert max(star.times.values()) == pytest.approx((8e9 + 16e6) / share + 0.05)


def test_every_scenario_loads():
    names = sorted(p.name for p in SCENARIOS.glob("*.toml"))
    assert {"hetero_1000.toml", "churn.toml", "two_jobs.toml", "sync.toml"} <= set(names)
    for path in SCENARIOS.glob("*.toml"):
        assert load_scenario(path).jobs


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"jobs": [{"id": "j", "rollouts_per_step": 8, "t_train_s": 1, "staleness": 1, "max_steps": 1, "bogus": 1}]},
         "jobs[0]: unknown field(s) bogus"),
        ({"jobs": [{"id": "j", "rollouts_per_step": 8, "t_train_s": 1, "staleness": 1, "publish_period": 3,
                    "max_steps": 1}]}, "exceeds S + 1 = 2"),
        ({"jobs": [{"id": "j", "rollouts_per_step": 8, "t_train_s": 1, "staleness": 65, "max_steps": 1}]},
         "jobs[j]: staleness: Input should be less than or equal to 64"),  # the platform's own bound
        ({"relay": {"topology": "mesh"}}, "relay.topology must be tree, chain or star"),
        ({"solver": {"method": "magic"}}, "solver: method must be one of"),
        ({"jobs": []}, "at least one [[jobs]] table"),
    ],
)  # fmt: skip
def test_bad_scenarios_name_the_field(patch, message):
    base = {
        "name": "t",
        "jobs": [{"id": "j", "rollouts_per_step": 8, "t_train_s": 1, "staleness": 1, "max_steps": 1}],
        "worker_types": [],
    }
    with pytest.raises(ScenarioError, match=None) as exc:
        scenario_from_dict({**base, **patch})
    assert message in str(exc.value)


def test_cli_prints_a_summary_and_json(capfd: pytest.CaptureFixture[str]):
    assert simulate_main([str(SCENARIOS / "churn.toml"), "--lines", "2"]) == 0
    out = capfd.readouterr().out
    assert "qwen3-1.7b-gsm8k" in out and "cost: learner $" in out and "churn:" in out
    assert simulate_main([str(SCENARIOS / "churn.toml"), "--json"]) == 0  # whatever HiGHS prints: not on stdout
    data = json.loads(capfd.readouterr().out)
    assert data["prompts_lost"] == 0 and data["jobs"][0]["completed"]
    assert simulate_main([str(SCENARIOS / "churn.toml"), "--scale", "3", "--lines", "0"]) == 0
    assert ": 780 workers," in capfd.readouterr().out  # 3 × (120 + 120 + 20)
    assert simulate_main(["does-not-exist.toml"]) == 2
    assert "scenario file not found" in capfd.readouterr().err


def test_no_flapping_in_closed_loop_under_measurement_noise():
    sc = load_scenario(SCENARIOS / "churn.toml")
    result = simulate(dataclasses.replace(sc, events=(), measure_noise=0.03))
    job = result.jobs[0]
    assert job.completed and job.prompts_lost == 0 and job.utilisation > 0.95
    first, *later = result.decisions
    assert first.activated > 0
    assert sum(d.activated + d.deactivated for d in later) == 0, [d.trigger for d in later]


def test_spot_preemption_and_rejoin_lose_nothing():
    sc = load_scenario(SCENARIOS / "churn.toml")
    spot = tuple(dataclasses.replace(t, preempt_mean_s=1800, rejoin_after_s=300) for t in sc.worker_types)
    result = simulate(dataclasses.replace(sc, worker_types=spot, events=()))
    job = result.jobs[0]
    assert len(result.kills) > 50 and result.lease_returns
    assert job.completed and job.prompts_lost == 0 and job.prompts_consumed == job.prompts_total
    assert all(r.returned_at - r.killed_at <= sc.lease_ttl_s + sc.tick_s for r in result.lease_returns)
    assert job.utilisation > 0.85


def test_deltas_let_workers_on_slow_links_stay_fresh():
    """Home uplinks: whole 2 GB versions never arrive within S steps, 20 MB deltas do (bench/freshness_bytes.py)."""
    from planner.sim.engine import simulate
    from planner.sim.scenario import scenario_from_dict

    def run(version_gb: float | None) -> float:
        scenario = scenario_from_dict({
            "name": "slow-links", "tick_s": 2.0, "solver": {"method": "all"},
            "jobs": [{"id": "j", "rollouts_per_step": 8, "t_train_s": 20.0, "staleness": 2, "max_steps": 30,
                      "model_gb": 2.0, "version_gb": version_gb}],
            "worker_types": [{"name": "home", "count": 4, "price_per_h": 0.2, "vram_gb": 24,
                              "backend": "transformers", "concurrency": 1, "t_gen_s": 2.0,
                              "down_mbps": [100, 100], "up_mbps": [20, 20]}],
        })
        return simulate(scenario).jobs[0].steady_utilisation

    whole, deltas = run(None), run(0.02)
    assert deltas > 0.9 and deltas > whole + 0.2, (whole, deltas)
