"""The one-line explanations of a decision: why each worker was activated, kept, left idle or skipped, and
why a job's set falls short of its rule."""

from __future__ import annotations

from collections.abc import Sequence

from .capacity import JobProfile, Miss, WorkerProfile, required_throughput
from .decision import Action, SolverConfig, SolverState, WorkerDecision
from .selection import Candidates, Pair


def keep_note(kept: float, best: float, config: SolverConfig, bound: bool) -> str:
    saving = max(0.0, 1 - best / kept) if kept else 0.0
    what = "no set is" if bound else "the re-solved set is"
    return f"kept current set ({what} more than {config.keep_bias:.0%} cheaper: {saving:.1%})"


def infeasible_reason(job: JobProfile, have: float, cands: Candidates) -> str:
    kinds: dict[Miss, int] = {}
    for per_job in cands.skipped.values():
        if job.job_id in per_job and (kind := per_job[job.job_id].kind) is not None:
            kinds[kind] = kinds.get(kind, 0) + 1
    excluded = ", ".join(f"{n} by {k}" for k, n in sorted(kinds.items()))
    return (
        f"infeasible: qualifying throughput {have:.2f} rollouts/s < needed {required_throughput(job):.2f} "
        f"(R={job.rollouts_per_step}, T_train={job.t_train_s:g}s, h={job.headroom:g})"
        + (f"; excluded: {excluded}" if excluded else "")
        + "; best partial set"
    )


def activate_reason(p: Pair, note: str, rank: int) -> str:
    per = p.worker.price_per_h / p.mu
    if not p.q.ok:
        prefix = "activate-all baseline, stale-prone" if note == "all" else "best effort, closest to fresh"
        return f"{prefix}: {p.q.reason}"
    fresh = f"T_bcast+T_gen {p.q.latency_s:.1f}s ≤ slack {p.q.slack_s:.1f}s"
    if p.q.share < 1:
        fresh += f", admissible share {p.q.share:.0%}"
    if note == "all":
        return f"activate-all baseline ({fresh})"
    if note == "partial":
        return f"best partial set: every qualifying worker is needed (${per:.2f}/h per rollout/s, {fresh})"
    if note.startswith("fair share"):
        return f"its fair share of a fleet too small for every job (${per:.2f}/h per rollout/s, {fresh})"
    if note.startswith("greedy"):
        return f"cheapest per rollout (#{rank}, ${per:.2f}/h per rollout/s) that still meets freshness ({fresh})"
    return f"in the minimum-price set meeting throughput and freshness (${per:.2f}/h per rollout/s, {fresh})"


def others(
    worker_id: str, job_id: str | None, jobs: list[JobProfile], cands: Candidates
) -> tuple[tuple[str, Action, str], ...]:
    """Why the worker, serving `job_id` or none, does not serve each running job other than its own."""
    skipped = cands.skipped.get(worker_id, {})
    out = []
    for job in jobs:
        if job.job_id == job_id:
            continue
        if job.job_id in skipped:
            out.append((job.job_id, Action.SKIP, skipped[job.job_id].reason))
        elif job_id is not None:
            out.append((job.job_id, Action.SKIP, f"serves job {job_id} (one job at a time)"))
        else:
            out.append((job.job_id, Action.IDLE, "qualifies but not needed (rule met by cheaper workers)"))
    return tuple(out)


def unassigned_lines(
    jobs: list[JobProfile],
    workers: Sequence[WorkerProfile],
    state: SolverState,
    cands: Candidates,
    assignment: dict[str, str],
) -> list[WorkerDecision]:
    running = {j.job_id for j in jobs}
    candidates = {p.worker.worker_id for ps in cands.fresh.values() for p in ps}
    lines = []
    for w in workers:
        wid = w.worker_id
        if wid in assignment:
            continue
        before = state.assignment.get(wid)
        reasons = {job_id: q.reason for job_id, q in cands.skipped.get(wid, {}).items()}
        if before is not None:
            if before not in running:
                why = f"job {before} no longer running"
            elif before in reasons:
                why = f"no longer qualifies: {reasons[before]}"
            else:
                # leaving a $0/h worker out makes no set cheaper: it goes because the job needs fewer workers
                cheaper = "a cheaper set" if w.price_per_h else "a set of fewer workers"
                why = f"{cheaper} meets the rule without it"
            action = Action.DEACTIVATE
        elif wid in candidates:
            action, why = Action.IDLE, "qualifies but not needed (rule met by cheaper workers)"
        else:
            distinct = set(reasons.values())
            why = distinct.pop() if len(distinct) == 1 else "; ".join(f"{j}: {r}" for j, r in reasons.items())
            action, why = Action.SKIP, why or "no running job"
        lines.append(WorkerDecision(wid, action, None, why, others(wid, None, jobs, cands)))
    return lines
