"""Cost-aware activation: choose which workers serve which job.

For every job, in priority order, pick the active set A minimising Σ price_i subject to the
capacity rule (planner.capacity) and the hard constraints, with no worker the rest of A meets the rule
without ($0/h workers make many sets equally cheap); a worker serves one job at a time.
Exact MILP with `scipy.optimize.milp` under a time limit; greedy by price/μ as the fallback and
the baseline; "all" (every live worker that can run the job) as the naive baseline.

Several jobs: one joint MILP (each job's throughput row, one job per worker) when every job can
be satisfied together; otherwise jobs take, in priority order, the cheapest set their rule needs
from what is left, and jobs of equal priority that cannot all be met share it fairly (the least
covered takes the next worker). A job that cannot be satisfied gets its best partial set: every qualifying
worker left, then — so that it is never left with nothing — the live workers that miss only
freshness, closest to fresh first, each marked as such, and a reason naming what excluded the
rest. A job that needs nothing now (demand 0: a Tinker model nobody samples) takes no worker beyond those its
dwell time holds, whether or not any worker qualifies for it.

Hysteresis, so the set does not flap:
  * re-solve only on a trigger: first decision, job set changed, churn (an assigned worker lost,
    a worker joined or came back), a price change, the end of a worker's dwell time (it may go where
    a job is short, or give way to a cheaper set), > `drift` relative change since the last
    solve of a measured input the rule depends on — a job's T_train, an assigned worker's μ —
    an assigned worker whose freshness verdict flipped, a job whose set fell more than `drift`
    below its rule (latency matters only through that verdict and through the admissible
    share u that the throughput sum uses; sets are chosen tight, so measurement noise alone
    would otherwise re-solve them), or every `infeasible_retry_s` while a job is infeasible. Idle
    workers' figures are estimates or old measurements; chasing their noise would re-solve
    every tick on a large pool, so among them only churn and price changes trigger;
  * a worker stays on its job for at least `min_dwell_s` while it still qualifies;
  * workers already serving a job look `keep_bias` cheaper to the solver, so a marginally
    cheaper set does not replace a running one.

`decide()` is pure: it takes the previous `SolverState` and returns a `Decision` (decision.py) carrying
the next one, every input it used, and a one-line explanation per worker (explain.py); the triggers
are in triggers.py, the set selection in selection.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from .capacity import (
    JobProfile,
    WorkerProfile,
    freshness_slack_s,
    predict_utilisation,
    qualify,
    required_throughput,
    sort_jobs,
)
from .decision import Action, Decision, JobAllocation, SolverConfig, SolverState, WorkerDecision
from .explain import activate_reason, infeasible_reason, keep_note, others, unassigned_lines
from .selection import TOL, Candidates, Pair, candidates, current_sets, lp_bound, select
from .triggers import fingerprint, resolve_trigger
from .workers import WorkerTable


def decide(
    jobs: Sequence[JobProfile],
    workers: Sequence[WorkerProfile],
    now: float,
    state: SolverState | None = None,
    config: SolverConfig | None = None,
) -> Decision:
    """One reconcile step: keep the previous set, or re-solve it when a trigger fires.

    `jobs` are the running jobs, `workers` every known worker (dead ones with alive=False), as a list or
    as a WorkerTable the caller keeps across steps (planner/workers.py: cheaper on a large fleet);
    `state` is the previous decision's `state` (None the first time). Persist the returned
    `decision.state` and apply `decision.assignment` (worker_id -> job_id; absent: inactive).
    """
    config = config or SolverConfig()
    started = time.perf_counter()
    jobs = sort_jobs(jobs)
    workers = workers if isinstance(workers, WorkerTable) else WorkerTable(workers)
    trigger = resolve_trigger(jobs, workers, now, state, config)
    if trigger is None and state is not None:
        return _keep(jobs, workers, now, state, config, started)
    state = state or SolverState()
    cands = candidates(jobs, workers, now, state, config)
    # Set-level hysteresis: noisy inputs re-solve often, and near-equal sets must not swap each
    # time. Keep the current sets while they cover their rules within `drift` unless another
    # set is more than `keep_bias` cheaper; the LP bound settles most cases without a MILP.
    current = current_sets(jobs, cands, config) if config.method != "all" else None
    if current is not None:
        kept = sum(p.worker.price_per_h for ps in current.values() for p in ps)
        bound = sum(lp_bound(cands.fresh[j.job_id], required_throughput(j)) for j in jobs)
        if bound >= kept * (1 - config.keep_bias):
            note = keep_note(kept, bound, config, bound=True)
            return _record(jobs, workers, now, state, config, trigger or "", started, cands, current,
                           {j.job_id: note for j in jobs})  # fmt: skip
    chosen, notes = select(jobs, cands, config)
    if current is not None:
        best = sum(p.worker.price_per_h for ps in chosen.values() for p in ps)
        if best >= kept * (1 - config.keep_bias):
            chosen, notes = current, {j.job_id: keep_note(kept, best, config, bound=False) for j in jobs}
    return _record(jobs, workers, now, state, config, trigger or "", started, cands, chosen, notes)


def _allocation(
    job: JobProfile, assigned: list[WorkerProfile], have: float, feasible: bool, reason: str
) -> JobAllocation:
    return JobAllocation(
        job_id=job.job_id,
        worker_ids=tuple(sorted(w.worker_id for w in assigned)),
        throughput=have,
        required=required_throughput(job),
        slack_s=freshness_slack_s(job),
        price_per_h=sum(w.price_per_h for w in assigned),
        feasible=feasible,
        reason=reason,
        predicted_utilisation=predict_utilisation(job, assigned),
    )


def _keep(
    jobs: list[JobProfile],
    workers: WorkerTable,
    now: float,
    state: SolverState,
    config: SolverConfig,
    started: float,
) -> Decision:
    allocations, read = [], []
    for job in jobs:
        assigned = [workers.profile(w) for w, j in sorted(state.assignment.items()) if j == job.job_id]
        read += assigned
        feasible = job.job_id not in state.infeasible_jobs
        reason = "meets the capacity rule" if feasible else "infeasible at the last solve"
        have = sum(q.mu for q in (qualify(w, job) for w in assigned) if q.ok)
        allocations.append(_allocation(job, assigned, have, feasible, reason))
    lines = tuple(
        WorkerDecision(w, Action.KEEP, j, "no trigger since last solve") for w, j in sorted(state.assignment.items())
    )
    new_state = SolverState(
        dict(state.assignment),
        dict(state.activated_at),
        dict(state.qualified),
        state.solved_at,
        state.fingerprint,
        list(state.infeasible_jobs),
    )
    return Decision(
        now, "none: inputs within tolerance", False, "kept", tuple(allocations), lines, new_state,
        tuple(jobs), tuple(read), time.perf_counter() - started,
    )  # fmt: skip


def _record(
    jobs: list[JobProfile],
    workers: WorkerTable,
    now: float,
    state: SolverState,
    config: SolverConfig,
    trigger: str,
    started: float,
    cands: Candidates,
    chosen: dict[str, list[Pair]],
    notes: dict[str, str],
) -> Decision:
    assignment: dict[str, str] = {}
    activated_at: dict[str, float] = {}
    qualified: dict[str, bool] = {}
    lines: list[WorkerDecision] = []
    allocations, infeasible = [], []
    for job in jobs:
        picked = chosen[job.job_id]
        have = sum(p.mu for p in picked if p.q.ok)
        slack = config.drift if notes[job.job_id].startswith("kept current set") else TOL
        feasible = have >= required_throughput(job) * (1 - slack)
        if not feasible:
            infeasible.append(job.job_id)
        reason = "meets the capacity rule" if feasible else infeasible_reason(job, have, cands)
        if feasible and have < required_throughput(job) * (1 - TOL):
            reason = f"within {config.drift:.0%} of the capacity rule ({have:.2f}/{required_throughput(job):.2f})"
        if required_throughput(job) <= 0:
            reason = "no demand: it needs no worker now"
        allocations.append(_allocation(job, [p.worker for p in picked], have, feasible, reason))
        for rank, p in enumerate(sorted(picked, key=lambda p: (p.cost / p.mu, p.worker.worker_id)), 1):
            wid = p.worker.worker_id
            assignment[wid] = job.job_id
            qualified[wid] = p.q.ok
            if state.assignment.get(wid) == job.job_id:
                activated_at[wid] = state.activated_at.get(wid, now)
                dwell = now - activated_at[wid]
                why = f"within dwell time ({dwell:.0f}s < {config.min_dwell_s:.0f}s)" if p.locked else None
                if why is None and notes[job.job_id].startswith("kept current set"):
                    why = notes[job.job_id]
                why = why or ("still chosen" if p.q.ok else activate_reason(p, notes[job.job_id], rank))
                action = Action.KEEP
            else:
                activated_at[wid] = now
                action, why = Action.ACTIVATE, activate_reason(p, notes[job.job_id], rank)
            lines.append(WorkerDecision(wid, action, job.job_id, why, others(wid, job.job_id, jobs, cands)))
    lines += unassigned_lines(jobs, workers, state, cands, assignment)
    new_state = SolverState(
        assignment, activated_at, qualified, now, fingerprint(jobs, workers), infeasible
    )  # fmt: skip
    parts = [f"{j}: {n}" for j, n in notes.items()]
    method = "; ".join(parts) if len(parts) > 1 else next(iter(notes.values()), "")
    return Decision(
        now, trigger, True, method, tuple(allocations), tuple(lines), new_state,
        tuple(jobs), tuple(workers), time.perf_counter() - started,
    )  # fmt: skip
