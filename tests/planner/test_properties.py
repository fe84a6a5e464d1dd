"""The planner under random fleets and demands, zeros and empties included: it never raises, and what it
returns obeys the rule's invariants (one job per worker, only running jobs, a job that needs nothing takes
nothing, a job called feasible covers its need, one line per worker) — decided once and again from its state."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from planner.capacity import JobProfile, WorkerPerf, WorkerProfile, hard_constraint_violation, required_throughput
from planner.decision import METHODS, SolverConfig
from planner.selection import TOL
from planner.solver import decide

rates = st.one_of(st.just(0.0), st.floats(1e-3, 1e3))
seconds = st.one_of(st.just(0.0), st.floats(1e-3, 1e4))
backends = st.frozensets(st.sampled_from(["vllm", "transformers"]), max_size=2)


@st.composite
def jobs(draw) -> list[JobProfile]:
    out = []
    for i in range(draw(st.integers(0, 4))):
        staleness = draw(st.integers(0, 4))
        out.append(JobProfile(
            job_id=f"j{i}", rollouts_per_step=draw(st.integers(0, 64)), t_train_s=draw(st.floats(1e-3, 600)),
            staleness=staleness, publish_period=draw(st.integers(1, staleness + 1)),
            headroom=draw(st.floats(0, 1)), vram_need_gb=draw(st.sampled_from([0.0, 8.0, 80.0])),
            backends=draw(backends), priority=draw(st.integers(-1, 1)), submitted_at=float(i)))
    return out


@st.composite
def workers(draw, job_ids: list[str]) -> list[WorkerProfile]:
    out = []
    for i in range(draw(st.integers(0, 8))):
        measured = draw(st.lists(st.sampled_from(job_ids), unique=True)) if job_ids else []
        out.append(WorkerProfile(
            worker_id=f"w{i}", price_per_h=draw(st.floats(0, 10)), vram_gb=draw(st.sampled_from([0.0, 16.0, 96.0])),
            backends=draw(backends), mu=draw(rates), t_gen_s=draw(seconds), t_bcast_s=draw(seconds),
            alive=draw(st.booleans()),
            perf_by_job={j: WorkerPerf(draw(rates), draw(seconds), draw(seconds)) for j in measured}))
    return out


def check(decision, job_list: list[JobProfile], fleet: list[WorkerProfile]) -> None:
    by_id, running = {w.worker_id: w for w in fleet}, {j.job_id: j for j in job_list}
    assert sorted(x.worker_id for x in decision.workers) == sorted(by_id) or not decision.resolved
    for worker_id, job_id in decision.assignment.items():
        assert job_id in running
        assert hard_constraint_violation(by_id[worker_id], running[job_id]) is None
    for allocation in decision.jobs:
        job = running[allocation.job_id]
        if required_throughput(job) == 0 and decision.state.activated_at == {}:
            assert allocation.worker_ids == ()
        if allocation.feasible and not decision.method.startswith("kept"):
            assert allocation.throughput >= required_throughput(job) * (1 - 0.1) - TOL


@settings(max_examples=150, deadline=None)
@given(data=st.data(), method=st.sampled_from(METHODS))
def test_the_planner_plans_any_fleet_and_any_demand(data, method):
    job_list = data.draw(jobs())
    fleet = data.draw(workers([j.job_id for j in job_list]))
    config = SolverConfig(method=method, time_limit_s=1.0, min_dwell_s=data.draw(st.sampled_from([0.0, 60.0])))
    first = decide(job_list, fleet, now=0.0, config=config)
    check(first, job_list, fleet)
    # the next tick: demands and rates moved, a worker may have died, a job may have ended
    moved = [replace(j, rollouts_per_step=data.draw(st.integers(0, 64))) for j in job_list[1:]]
    fleet = [replace(w, alive=data.draw(st.booleans()), mu=data.draw(rates)) for w in fleet]
    second = decide(moved, fleet, now=30.0, state=first.state, config=config)
    check(second, moved, fleet)
