"""The simulator decides as it did before it was made fast (issue 32): each scenario's decision trace —
every re-solve's trigger, method, sets, reasons and per-worker lines, the jobs' figures, kills and lease
returns — hashes to the fingerprint recorded with the code of main cca2bb8. A change that means to alter
decisions must say so and record the new fingerprints; one that only speeds things up must not move them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from planner.sim import Scenario, SimResult, load_scenario, simulate

SCENARIOS = Path(__file__).resolve().parents[2] / "planner" / "sim" / "scenarios"

RECORDED = {
    "hetero_1000": "39bbc99584d9053ab5e34366c2c7db47ceedafb6da1a1f82681aa606713ebc83",
    "hetero_1000 greedy": "3a877a9b5856021b012b17a872645872312507cd30324a1c56645f771d11835c",
    "churn": "99700e98e2afbe153022d6e03631fbdef93f361aec38222b8d29d3d5af72048e",
    "churn with measurement noise": "c8d5c7737610ace18233d977bb81eee215952a92c1c45cd72788c1b8f0088cb2",
    "two_jobs": "8511fbffcf351daa55a6b579d9108b4014ba011b57a03e637560b13f687b2501",
    "sync": "6f252acb7b0fbec0e9f514da0c283ae161fe2d0fc1b91a4351d4eb41a95b1252",
}


def scenario(name: str) -> Scenario:
    base, _, variant = name.partition(" ")
    sc = load_scenario(SCENARIOS / f"{base}.toml")
    if variant == "greedy":
        return dataclasses.replace(sc, solver=dataclasses.replace(sc.solver, method="greedy"))
    if variant == "with measurement noise":
        return dataclasses.replace(sc, events=(), measure_noise=0.03)
    return sc


def _r(x: float) -> float:
    return float(f"{x:.9g}")  # floats to 9 digits: the trace, not the last bit of a sum


def trace(result: SimResult) -> dict:
    decisions = [
        [_r(d.at), d.trigger, d.resolved, d.method,
         [[a.job_id, list(a.worker_ids), _r(a.throughput), _r(a.required), _r(a.slack_s), _r(a.price_per_h),
           a.feasible, a.reason, _r(a.predicted_utilisation)] for a in d.jobs],
         [[w.worker_id, str(w.action), w.job_id, w.reason, [list(map(str, o)) for o in w.others]] for w in d.workers]]
        for d in result.full_decisions
    ]  # fmt: skip
    jobs = [[j.job_id, j.completed, j.steps, _r(j.wall_s), _r(j.busy_s), j.dropped_stale, j.prompts_consumed,
             j.prompts_lost, _r(j.worker_cost), j.activations, j.deactivations, j.peak_active] for j in result.jobs]
    return {"decisions": decisions, "jobs": jobs, "kills": [[_r(t), w] for t, w in result.kills],
            "returns": [[r.worker_id, _r(r.killed_at), _r(r.returned_at), r.prompts] for r in result.lease_returns]}


def fingerprint(result: SimResult) -> str:
    return hashlib.sha256(json.dumps(trace(result), sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize("name", RECORDED)
def test_decision_trace_is_the_recorded_one(name: str):
    result = simulate(scenario(name))
    assert fingerprint(result) == RECORDED[name], f"{name}: the simulator's decisions changed"
