"""The capacity rule: throughput, freshness (incl. synchronous mode), hard constraints, utilisation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.capacity import (
    JobProfile,
    Miss,
    WorkerPerf,
    WorkerProfile,
    admissible_share,
    estimate_bcast_s,
    freshness_slack_s,
    hard_constraint_violation,
    meets_throughput,
    predict_utilisation,
    qualify,
    required_throughput,
    sort_jobs,
    throughput,
    validate_job,
    waits_each_window,
)


def job(**kw) -> JobProfile:
    base = dict(job_id="j1", rollouts_per_step=64, t_train_s=10.0, staleness=2, publish_period=1, vram_need_gb=16)
    return JobProfile(**{**base, **kw})


def worker(wid: str = "w1", mu: float = 1.0, t_bcast: float = 5.0, t_gen: float = 4.0, **kw) -> WorkerProfile:
    base = dict(price_per_h=0.5, vram_gb=24, backends=frozenset({"vllm"}))
    return WorkerProfile(worker_id=wid, mu=mu, t_gen_s=t_gen, t_bcast_s=t_bcast, **{**base, **kw})


def test_required_throughput_is_one_plus_h_times_r_over_t_train():
    assert required_throughput(job()) == pytest.approx(1.1 * 64 / 10)
    assert required_throughput(job(headroom=0.0)) == pytest.approx(6.4)


def test_freshness_slack_is_s_minus_kappa_plus_one_steps():
    assert freshness_slack_s(job(staleness=2, publish_period=1)) == pytest.approx(20.0)
    assert freshness_slack_s(job(staleness=4, publish_period=2)) == pytest.approx(30.0)
    assert freshness_slack_s(job(staleness=1, publish_period=1)) == pytest.approx(10.0)


def test_freshness_excludes_slow_broadcast_worker_and_says_why():
    j = job(t_train_s=10.0, staleness=2)  # slack 20 s
    fast = qualify(worker(t_bcast=12.0, t_gen=8.0), j)  # exactly on the slack
    slow = qualify(worker(t_bcast=33.0, t_gen=8.0), j)
    assert fast.ok and fast.kind is None
    assert not slow.ok and slow.kind is Miss.freshness
    assert slow.reason == "T_bcast+T_gen 41.0s > slack 20.0s"


def test_synchronous_mode_caps_latency_at_one_step_and_predicts_idle_learner():
    sync = job(staleness=0, publish_period=1, t_train_s=10.0, rollouts_per_step=10, headroom=0.0)
    assert waits_each_window(sync)
    assert validate_job(sync) == []
    # the literal slack (S − κ + 1)·T_train would be 0: nobody with any latency could qualify
    assert freshness_slack_s(sync) == pytest.approx(10.0)
    assert qualify(worker(t_bcast=6.0, t_gen=4.0), sync).ok
    assert not qualify(worker(t_bcast=7.0, t_gen=4.0), sync).ok
    ws = [worker(f"w{i}", mu=1.0, t_bcast=3.0, t_gen=2.0) for i in range(5)]  # R/Σμ = 2 s
    # wait = max T_bcast + max(max T_gen, R/Σμ) = 3 + 2
    assert predict_utilisation(sync, ws) == pytest.approx(10.0 / 15.0)
    # the same set in asynchronous mode keeps the learner busy
    assert predict_utilisation(job(staleness=2, rollouts_per_step=10, t_train_s=10.0), ws) == 1.0


def test_validate_job_rejects_publish_period_beyond_staleness_plus_one():
    assert any("exceeds S + 1 = 2" in p for p in validate_job(job(staleness=1, publish_period=3)))
    assert any("exceeds S + 1 = 1" in p for p in validate_job(job(staleness=0, publish_period=2)))
    assert validate_job(job(staleness=1, publish_period=2)) == []  # κ = S + 1: the protocol allows it
    assert any("headroom" in p for p in validate_job(job(headroom=-0.2)))
    assert validate_job(job(staleness=3, publish_period=3)) == []


def test_publish_period_of_s_plus_one_waits_once_per_window_instead_of_qualifying_nobody():
    j = job(staleness=1, publish_period=2, t_train_s=10.0, rollouts_per_step=10, headroom=0.0)
    assert waits_each_window(j) and freshness_slack_s(j) == pytest.approx(10.0)
    ws = [worker(f"w{i}", mu=1.0, t_bcast=3.0, t_gen=2.0) for i in range(5)]
    assert all(qualify(w, j).ok for w in ws)  # literally (S − κ + 1)·T = 0 s: nobody would
    # a 20 s window (κ = 2 steps) plus one wait of max T_bcast + max(max T_gen, R/Σμ) = 3 + 2
    assert predict_utilisation(j, ws) == pytest.approx(20.0 / 25.0)


@pytest.mark.parametrize(
    ("kw", "kind", "reason"),
    [
        ({"vram_gb": 12}, Miss.vram, "VRAM 12 GiB < need 16 GiB"),
        ({"backends": frozenset({"transformers"})}, Miss.backend,
         "backend transformers not supported (job needs vllm)"),
        ({"alive": False}, Miss.liveness, "not alive"),
        ({"mu": 0.0}, Miss.throughput, "no measured throughput"),
    ],
)
def test_hard_constraints(kw, kind, reason):
    j = job(backends=frozenset({"vllm"}))
    assert hard_constraint_violation(worker(**kw), j) == (kind, reason)
    q = qualify(worker(**kw), j)
    assert not q.ok and q.kind is kind and q.reason == reason


def test_empty_backend_set_accepts_any_backend():
    assert hard_constraint_violation(worker(backends=frozenset({"transformers"})), job()) is None


def test_throughput_counts_only_qualifying_workers():
    j = job(rollouts_per_step=20, t_train_s=10.0, headroom=0.0)  # needs 2.0
    ws = [worker("a", mu=1.0), worker("b", mu=0.5), worker("slow", mu=5.0, t_bcast=100.0)]
    assert throughput(ws, j) == pytest.approx(1.5)
    assert not meets_throughput(ws, j)
    assert meets_throughput([*ws, worker("c", mu=0.5)], j)
    assert predict_utilisation(j, ws) == pytest.approx(0.75)


def test_per_job_measurements_override_defaults():
    w = worker(mu=1.0, perf_by_job={"j2": WorkerPerf(mu=0.25, t_gen_s=30.0, t_bcast_s=50.0)})
    assert w.perf_for("j1") == WorkerPerf(1.0, 4.0, 5.0)
    assert w.perf_for("j2").mu == 0.25
    assert (w.mu_for("j1"), w.mu_for("j2")) == (1.0, 0.25)
    assert not qualify(w, job(job_id="j2")).ok


def test_estimate_bcast_is_pipelined():
    # 8 GB at 1 Gbit/s = 64 s, plus 3 hops of one 16 MB chunk (0.128 s) and 50 ms latency
    t = estimate_bcast_s(8e9, down_bps=125e6, relay_bps=1e9, depth=3, chunk_bytes=16e6, hop_latency_s=0.05)
    assert t == pytest.approx(64 + 3 * (0.128 + 0.05))
    assert estimate_bcast_s(8e9, 0.0, 1e9, 1, 16e6) == math.inf
    assert type(t) is float


def test_estimate_bcast_of_a_fleet_in_one_call_is_each_workers_own():
    down = [125e6, 1e9, 5e9, 0.0]
    fleet = estimate_bcast_s(8e9, np.array(down), 1e9, np.array([3, 1, 2, 1]), 16e6, 0.05)
    each = [estimate_bcast_s(8e9, d, 1e9, depth, 16e6, 0.05) for d, depth in zip(down, [3, 1, 2, 1], strict=True)]
    assert fleet.tolist() == each  # to the last bit: the simulator's decisions must not move


def test_jobs_sort_by_priority_then_submission():
    jobs = [job(job_id="c", submitted_at=1), job(job_id="a", priority=2, submitted_at=5), job(job_id="b")]
    assert [j.job_id for j in sort_jobs(jobs)] == ["a", "b", "c"]


def test_admissible_share_counts_only_what_the_learner_can_still_train():
    j = job(staleness=2, publish_period=1, t_train_s=20.0)  # slack 40 s
    # W = S·T − L = 5 s: one 12 s group per slot per 20 s version window
    assert admissible_share(WorkerPerf(1.0, t_gen_s=12.0, t_bcast_s=23.0), j) == pytest.approx(0.6)
    assert admissible_share(WorkerPerf(1.0, t_gen_s=12.0, t_bcast_s=8.0), j) == 1.0  # L ≤ (S − κ)·T
    q = qualify(worker(mu=2.0, t_bcast=23.0, t_gen=12.0), j)
    assert q.ok and q.share == pytest.approx(0.6) and q.mu == pytest.approx(1.2)
    # PRIME-RL k = 1: one batch per step, generation as long as a step, instant broadcast
    assert admissible_share(WorkerPerf(1.0, t_gen_s=10.0, t_bcast_s=0.0), job(staleness=1, t_train_s=10.0)) == 1.0
    # every worker inside the freshness bound keeps a positive share
    for latency in (1.0, 20.0, 39.0, 40.0):
        assert admissible_share(WorkerPerf(1.0, t_gen_s=10.0, t_bcast_s=latency - 10.0), j) > 0
    assert (
        admissible_share(WorkerPerf(1.0, 10.0, 1000.0), job(staleness=0, t_train_s=10.0)) == 1.0
    )  # sync: learner waits
