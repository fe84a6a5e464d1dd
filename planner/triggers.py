"""Hysteresis: whether the active set must be re-solved now (solver.py's docstring lists the triggers)."""

from __future__ import annotations

from collections.abc import Sequence

from .capacity import JobProfile, qualify, required_throughput
from .decision import SolverConfig, SolverState
from .workers import WorkerTable


def fingerprint(jobs: Sequence[JobProfile], workers: WorkerTable) -> dict:
    return {
        "jobs": {j.job_id: (j.rollouts_per_step, j.t_train_s) for j in jobs},
        "workers": workers.marks(),
        "mu": {f"{w.worker_id}|{j.job_id}": (w.mu_for(j.job_id),) for w in workers for j in jobs},
    }


def _drifted(old: float, new: float, tolerance: float) -> bool:
    """Relative change beyond tolerance (any change away from zero counts)."""
    if old == new:
        return False
    return old == 0 or abs(new - old) / abs(old) > tolerance


def _fleet_change(workers: WorkerTable, marks: dict, state: SolverState) -> str | None:
    """The first worker that joined, came back, or changed its price since the last solve."""
    for w in workers:
        prev = marks.get(w.worker_id)
        if prev is None:
            if w.alive:
                return f"churn: {w.worker_id} joined"
            continue
        price, alive = prev
        if w.alive and not alive:
            return f"churn: {w.worker_id} back"
        if w.price_per_h != price and (w.alive or w.worker_id in state.assignment):
            return f"price change: {w.worker_id} ${price:.2f}→${w.price_per_h:.2f}/h"
    return None


def resolve_trigger(
    jobs: Sequence[JobProfile],
    workers: WorkerTable,
    now: float,
    state: SolverState | None,
    config: SolverConfig,
) -> str | None:
    """Why the active set must be re-solved now, or None to keep it."""
    if state is None or not state.fingerprint:
        return "first decision"
    old = state.fingerprint
    job_ids = {j.job_id for j in jobs}
    if job_ids != set(old["jobs"]):
        added = [f"+{j}" for j in sorted(job_ids - set(old["jobs"]))]
        gone = [f"-{j}" for j in sorted(set(old["jobs"]) - job_ids)]
        return "job set changed: " + ", ".join(added + gone)
    for job in jobs:
        r, t_train = old["jobs"][job.job_id]
        if job.rollouts_per_step != r:
            return f"input change: {job.job_id} R {r}→{job.rollouts_per_step}"
        if _drifted(t_train, job.t_train_s, config.drift):
            return f"drift: {job.job_id} T_train {t_train:.1f}s→{job.t_train_s:.1f}s (> {config.drift:.0%})"
    for wid in sorted(state.assignment):
        if (worker := workers.get(wid)) is None or not worker.alive:
            return f"churn: {wid} lost"
    if workers.marks_differ(old["workers"]) and (change := _fleet_change(workers, old["workers"], state)):
        return change
    jobs_by_id = {j.job_id: j for j in jobs}
    for wid, job_id in sorted(state.assignment.items()):
        worker, job = workers.profile(wid), jobs_by_id[job_id]
        prev_mu = old["mu"].get(f"{wid}|{job_id}")
        mu = worker.mu_for(job_id)
        if prev_mu is not None and _drifted(prev_mu[0], mu, config.drift):
            return f"drift: {wid} μ {prev_mu[0]:.3g}→{mu:.3g} (> {config.drift:.0%})"
        q = qualify(worker, job)
        if q.ok != state.qualified.get(wid, True):
            verdict = "now meets freshness" if q.ok else "no longer qualifies"
            return f"drift: {wid} {verdict} ({q.reason})"
    freed = sorted(wid for wid, at in state.activated_at.items()
                   if wid in state.assignment and state.solved_at < at + config.min_dwell_s <= now)
    if freed:  # held by its dwell time at the last solve, it may now go where a job is short, or give way to a
        # cheaper set (set-level hysteresis then keeps what is within keep_bias): a $10/h worker kept its job
        # for good beside idle $1/h ones that met the job's rule, once no other trigger came
        why = "move to a job that is short" if state.infeasible_jobs else "give way to a cheaper set"
        return f"dwell over: {freed[0]} may {why}"
    for job in jobs:
        if job.job_id in state.infeasible_jobs:
            if now - state.solved_at >= config.infeasible_retry_s:
                return f"retry: {job.job_id} infeasible since t={state.solved_at:.0f}s"
            continue
        assigned = [workers.profile(w) for w, j in state.assignment.items() if j == job.job_id]
        have = sum(q.mu for q in (qualify(w, job) for w in assigned) if q.ok)
        need = required_throughput(job)
        if have < need * (1 - config.drift):
            return f"deficit: {job.job_id} has {have:.2f}/{need:.2f} rollouts/s (> {config.drift:.0%} short)"
    return None
