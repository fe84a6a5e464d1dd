"""Cost-aware activation: choose which workers serve which job.

For every job, in priority order, pick the active set A minimising Σ price_i subject to the
capacity rule (scheduler.capacity) and the hard constraints; a worker serves one job at a time.
Exact MILP with `scipy.optimize.milp` under a time limit; greedy by price/μ as the fallback and
the baseline; "all" (every live worker that can run the job) as the naive baseline.

Several jobs: one joint MILP (each job's throughput row, one job per worker) when every job can
be satisfied together; otherwise jobs take, in priority order, the cheapest set their rule needs
from what is left, and jobs of equal priority that cannot all be met share it fairly (the least
covered takes the next worker). A job that cannot be satisfied gets its best partial set: every qualifying
worker left, then — so that it is never left with nothing — the live workers that miss only
freshness, closest to fresh first, each marked as such, and a reason naming what excluded the
rest.

Hysteresis, so the set does not flap:
  * re-solve only on a trigger: first decision, job set changed, churn (an assigned worker lost,
    a worker joined or came back), a price change, the end of a worker's dwell time while a job is
    short of its rule, > `drift` relative change since the last
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

`decide()` is pure: it takes the previous `SolverState` and returns a `Decision` carrying the
next one, every input it used, and a one-line explanation per worker.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from scheduler.capacity import (
    JobProfile,
    Qualification,
    WorkerProfile,
    freshness_slack_s,
    predict_utilisation,
    qualify,
    required_throughput,
    sort_jobs,
)

METHODS = ("milp", "greedy", "all")
_TOL = 1e-9


@dataclass(frozen=True, slots=True)
class SolverConfig:
    method: str = "milp"  # "milp" | "greedy" | "all"
    time_limit_s: float = 5.0  # per MILP solve
    mip_rel_gap: float = 1e-4
    min_dwell_s: float = 600.0
    drift: float = 0.10
    keep_bias: float = 0.05
    infeasible_retry_s: float = 300.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")


class Action(StrEnum):
    ACTIVATE = "activated"
    KEEP = "kept"
    DEACTIVATE = "deactivated"
    IDLE = "idle"
    SKIP = "skipped"


@dataclass(frozen=True, slots=True)
class WorkerDecision:
    worker_id: str
    action: Action
    job_id: str | None  # the job it serves after this decision (None when not serving)
    reason: str
    # For each other running job: why the worker does not serve it (IDLE: qualifies, not needed; SKIP:
    # the constraint it misses, or the job it serves instead), so every job can explain every worker.
    others: tuple[tuple[str, Action, str], ...] = ()

    def line(self) -> str:
        return f"{self.action} {self.worker_id}: {self.reason}"


@dataclass(frozen=True, slots=True)
class JobAllocation:
    job_id: str
    worker_ids: tuple[str, ...]
    throughput: float  # Σ μ of the assigned workers that qualify
    required: float  # (1 + h) R / T_train
    slack_s: float
    price_per_h: float
    feasible: bool
    reason: str
    predicted_utilisation: float


@dataclass(slots=True)
class SolverState:
    """What the next decision needs from this one; JSON-serialisable via to_dict/from_dict."""

    assignment: dict[str, str] = field(default_factory=dict)  # worker_id -> job_id
    activated_at: dict[str, float] = field(default_factory=dict)  # worker_id -> time
    qualified: dict[str, bool] = field(default_factory=dict)  # assigned worker -> fresh at solve
    solved_at: float = 0.0
    fingerprint: dict = field(default_factory=dict)  # inputs at the last solve
    infeasible_jobs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SolverState:
        fp = data.get("fingerprint") or {}
        return cls(
            assignment=dict(data.get("assignment", {})),
            activated_at={k: float(v) for k, v in data.get("activated_at", {}).items()},
            qualified={k: bool(v) for k, v in data.get("qualified", {}).items()},
            solved_at=float(data.get("solved_at", 0.0)),
            fingerprint={part: {k: tuple(v) for k, v in fp.get(part, {}).items()} for part in fp},
            infeasible_jobs=list(data.get("infeasible_jobs", [])),
        )


@dataclass(slots=True)
class Decision:
    at: float
    trigger: str  # why the set was (re)solved, or why it was kept
    resolved: bool
    method: str  # what produced the set: "milp", "greedy (fallback: ...)", "partial", "kept", ...
    jobs: tuple[JobAllocation, ...]
    workers: tuple[WorkerDecision, ...]
    state: SolverState
    job_inputs: tuple[JobProfile, ...]
    worker_inputs: tuple[WorkerProfile, ...]
    solve_s: float = 0.0

    @property
    def assignment(self) -> dict[str, str]:
        return dict(self.state.assignment)

    def changes(self) -> list[WorkerDecision]:
        return [w for w in self.workers if w.action in (Action.ACTIVATE, Action.DEACTIVATE)]

    def lines(self) -> list[str]:
        return [w.line() for w in self.workers]

    def to_dict(self) -> dict:
        def worker_row(w: WorkerProfile) -> dict:
            row = asdict(w)
            row["backends"] = sorted(w.backends)
            row["perf_by_job"] = {k: asdict(v) for k, v in w.perf_by_job.items()}
            return row

        def job_row(j: JobProfile) -> dict:
            return {**asdict(j), "backends": sorted(j.backends)}

        return {
            "at": self.at,
            "trigger": self.trigger,
            "resolved": self.resolved,
            "method": self.method,
            "solve_s": self.solve_s,
            "jobs": [asdict(a) for a in self.jobs],
            "workers": [{**asdict(w), "line": w.line()} for w in self.workers],
            "state": self.state.to_dict(),
            "inputs": {
                "jobs": [job_row(j) for j in self.job_inputs],
                "workers": [worker_row(w) for w in self.worker_inputs],
            },
        }


# ---------------------------------------------------------------- triggers (hysteresis)


def _fingerprint(jobs: Sequence[JobProfile], workers: Sequence[WorkerProfile]) -> dict:
    return {
        "jobs": {j.job_id: (j.rollouts_per_step, j.t_train_s) for j in jobs},
        "workers": {w.worker_id: (w.price_per_h, w.alive) for w in workers},
        "mu": {f"{w.worker_id}|{j.job_id}": (w.perf_for(j.job_id).mu,) for w in workers for j in jobs},
    }


def _drifted(old: float, new: float, tolerance: float) -> bool:
    """Relative change beyond tolerance (any change away from zero counts)."""
    if old == new:
        return False
    return old == 0 or abs(new - old) / abs(old) > tolerance


def resolve_trigger(
    jobs: Sequence[JobProfile],
    workers: Sequence[WorkerProfile],
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
    by_id = {w.worker_id: w for w in workers}
    for wid in sorted(state.assignment):
        if wid not in by_id or not by_id[wid].alive:
            return f"churn: {wid} lost"
    for w in workers:
        prev = old["workers"].get(w.worker_id)
        if prev is None:
            if w.alive:
                return f"churn: {w.worker_id} joined"
            continue
        price, alive = prev
        if w.alive and not alive:
            return f"churn: {w.worker_id} back"
        if w.price_per_h != price and (w.alive or w.worker_id in state.assignment):
            return f"price change: {w.worker_id} ${price:.2f}→${w.price_per_h:.2f}/h"
    jobs_by_id = {j.job_id: j for j in jobs}
    for wid, job_id in sorted(state.assignment.items()):
        worker, job = by_id[wid], jobs_by_id[job_id]
        prev_mu = old["mu"].get(f"{wid}|{job_id}")
        mu = worker.perf_for(job_id).mu
        if prev_mu is not None and _drifted(prev_mu[0], mu, config.drift):
            return f"drift: {wid} μ {prev_mu[0]:.3g}→{mu:.3g} (> {config.drift:.0%})"
        q = qualify(worker, job)
        if q.ok != state.qualified.get(wid, True):
            verdict = "now meets freshness" if q.ok else "no longer qualifies"
            return f"drift: {wid} {verdict} ({q.reason})"
    if state.infeasible_jobs:  # workers held by their dwell time at the last solve may now go where they are short
        freed = sorted(wid for wid, at in state.activated_at.items()
                       if wid in state.assignment and state.solved_at < at + config.min_dwell_s <= now)
        if freed:
            return f"dwell over: {freed[0]} may move to a job that is short"
    for job in jobs:
        if job.job_id in state.infeasible_jobs:
            if now - state.solved_at >= config.infeasible_retry_s:
                return f"retry: {job.job_id} infeasible since t={state.solved_at:.0f}s"
            continue
        assigned = [by_id[w] for w, j in state.assignment.items() if j == job.job_id]
        have = sum(q.mu for q in (qualify(w, job) for w in assigned) if q.ok)
        need = required_throughput(job)
        if have < need * (1 - config.drift):
            return f"deficit: {job.job_id} has {have:.2f}/{need:.2f} rollouts/s (> {config.drift:.0%} short)"
    return None


# ---------------------------------------------------------------- set selection


@dataclass(slots=True)
class _Pair:
    worker: WorkerProfile
    job: JobProfile
    q: Qualification
    cost: float  # price as the solver sees it (keep bias applied)
    locked: bool  # within dwell time on this job
    serving: bool  # already serving this job

    @property
    def mu(self) -> float:
        """Admissible throughput u·μ; the raw μ for best-effort workers that miss freshness."""
        return self.q.mu if self.q.ok else self.q.perf.mu


@dataclass(slots=True)
class _Candidates:
    fresh: dict[str, list[_Pair]]  # job -> pairs meeting every constraint
    stale: dict[str, list[_Pair]]  # job -> live pairs that miss only freshness
    skipped: dict[str, dict[str, str]]  # worker -> job -> why it does not qualify


def _candidates(
    jobs: list[JobProfile], workers: list[WorkerProfile], now: float, state: SolverState, config: SolverConfig
) -> _Candidates:
    fresh: dict[str, list[_Pair]] = {j.job_id: [] for j in jobs}
    stale: dict[str, list[_Pair]] = {j.job_id: [] for j in jobs}
    skipped: dict[str, dict[str, str]] = {}
    locked_to: dict[str, str] = {}
    for w in workers:
        current = state.assignment.get(w.worker_id)
        for job in jobs:
            on_job = current == job.job_id
            q = qualify(w, job)
            cost = w.price_per_h * (1 - config.keep_bias) if on_job else w.price_per_h
            dwell = now - state.activated_at.get(w.worker_id, now)
            pair = _Pair(w, job, q, cost, on_job and q.ok and dwell < config.min_dwell_s, on_job)
            if q.ok:
                fresh[job.job_id].append(pair)
                if pair.locked:
                    locked_to[w.worker_id] = job.job_id
                continue
            skipped.setdefault(w.worker_id, {})[job.job_id] = q.reason
            if w.alive and q.reason.startswith("T_bcast"):
                stale[job.job_id].append(pair)
    for table in (fresh, stale):  # a worker locked to one job is not a candidate for the others
        for job_id, ps in table.items():
            table[job_id] = [p for p in ps if locked_to.get(p.worker.worker_id, job_id) == job_id]
    return _Candidates(fresh, stale, skipped)


def _greedy(pairs: list[_Pair], demand: float) -> list[_Pair]:
    """Cheapest per rollout first until the demand is met, then drop what became redundant."""
    chosen = [p for p in pairs if p.locked]
    have = sum(p.mu for p in chosen)
    for p in sorted((p for p in pairs if not p.locked), key=lambda p: (p.cost / p.mu, p.cost, p.worker.worker_id)):
        if have >= demand * (1 - _TOL):
            break
        chosen.append(p)
        have += p.mu
    if have >= demand * (1 - _TOL):
        for p in sorted(chosen, key=lambda p: -p.cost):
            if not p.locked and have - p.mu >= demand * (1 - _TOL):
                chosen.remove(p)
                have -= p.mu
    return chosen


def _milp(pairs: list[_Pair], demands: dict[str, float], config: SolverConfig) -> tuple[list[_Pair] | None, str]:
    """min Σ cost·x  s.t.  Σ_i μ_ij x_ij ≥ D_j per job,  Σ_j x_ij ≤ 1 per worker,  x binary."""
    n = len(pairs)
    if n == 0:
        return None, "no candidates"
    job_row = {j: r for r, j in enumerate(demands)}
    worker_ids = sorted({p.worker.worker_id for p in pairs})
    worker_row = {w: len(demands) + r for r, w in enumerate(worker_ids)}
    rows, cols, vals = [], [], []
    for c, p in enumerate(pairs):
        rows += [job_row[p.job.job_id], worker_row[p.worker.worker_id]]
        cols += [c, c]
        vals += [p.mu, 1.0]
    a = coo_array((vals, (rows, cols)), shape=(len(demands) + len(worker_ids), n)).tocsr()
    lb_rows = np.array([*demands.values()] + [0.0] * len(worker_ids))
    ub_rows = np.array([np.inf] * len(demands) + [1.0] * len(worker_ids))
    res = milp(
        c=np.array([p.cost for p in pairs]),
        integrality=np.ones(n),
        bounds=Bounds(np.array([1.0 if p.locked else 0.0 for p in pairs]), np.ones(n)),
        constraints=[LinearConstraint(a, lb_rows, ub_rows)],
        options={"time_limit": config.time_limit_s, "mip_rel_gap": config.mip_rel_gap, "disp": False},
    )
    if res.x is None:
        return None, res.message
    chosen = [p for p, x in zip(pairs, res.x, strict=True) if x > 0.5]
    return chosen, "milp" if res.status == 0 else f"milp (best found: {res.message})"


def _best_partial(fresh: list[_Pair], stale: list[_Pair], demand: float) -> list[_Pair]:
    """Every qualifying worker, then live near-misses closest to fresh until the demand is met."""
    chosen = list(fresh)
    have = sum(p.mu for p in chosen)
    for p in sorted(stale, key=lambda p: (p.q.latency_s, p.cost / p.mu, p.worker.worker_id)):
        if have >= demand * (1 - _TOL):
            break
        chosen.append(p)
        have += p.mu
    return chosen


def _solve_job(fresh: list[_Pair], stale: list[_Pair], demand: float, config: SolverConfig) -> tuple[list[_Pair], str]:
    """Cheapest set for one job; the best partial set when even every qualifying worker is short."""
    if config.method == "all":
        return fresh + stale, "all"
    if sum(p.mu for p in fresh) < demand * (1 - _TOL):
        return _best_partial(fresh, stale, demand), "partial"
    greedy = _greedy(fresh, demand)
    if config.method == "greedy":
        return greedy, "greedy"
    chosen, note = _milp(fresh, {fresh[0].job.job_id: demand}, config)
    if chosen is None:
        return greedy, f"greedy (fallback: {note})"
    if sum(p.cost for p in greedy) < sum(p.cost for p in chosen) - _TOL:  # MILP stopped early
        return greedy, f"greedy (cheaper than {note})"
    return chosen, note


def _select(jobs: list[JobProfile], cands: _Candidates, config: SolverConfig) -> tuple[dict, dict]:
    chosen: dict[str, list[_Pair]] = {}
    notes: dict[str, str] = {}
    if config.method == "milp" and len(jobs) > 1:
        demands = {j.job_id: required_throughput(j) for j in jobs}
        joint, note = _milp([p for j in jobs for p in cands.fresh[j.job_id]], demands, config)
        if joint is not None:
            for job in jobs:
                chosen[job.job_id] = [p for p in joint if p.job.job_id == job.job_id]
                notes[job.job_id] = f"{note} (joint over {len(jobs)} jobs)"
            return chosen, notes
    taken: set[str] = set()
    for level in _priority_levels(jobs):
        picked, level_notes = _take_in_order(level, cands, config, taken)
        if len(level) > 1 and config.method != "all" and any(n == "partial" for n in level_notes.values()):
            picked, level_notes = _fair_share(level, cands, taken)
        chosen |= picked
        notes |= level_notes
        taken |= {p.worker.worker_id for ps in picked.values() for p in ps}
    return chosen, notes


def _priority_levels(jobs: list[JobProfile]) -> list[list[JobProfile]]:
    """The jobs (already in priority order) grouped by equal priority."""
    levels: list[list[JobProfile]] = []
    for job in jobs:
        if levels and levels[-1][0].priority == job.priority:
            levels[-1].append(job)
        else:
            levels.append([job])
    return levels


def _take_in_order(jobs: list[JobProfile], cands: _Candidates, config: SolverConfig,
                   taken: set[str]) -> tuple[dict, dict]:
    """Each job, oldest first, takes the cheapest set its rule needs from what is left."""
    chosen: dict[str, list[_Pair]] = {}
    notes: dict[str, str] = {}
    used = set(taken)
    for job in jobs:
        fresh = [p for p in cands.fresh[job.job_id] if p.worker.worker_id not in used]
        stale = [p for p in cands.stale[job.job_id] if p.worker.worker_id not in used]
        chosen[job.job_id], notes[job.job_id] = _solve_job(fresh, stale, required_throughput(job), config)
        used |= {p.worker.worker_id for p in chosen[job.job_id]}
    return chosen, notes


def _fair_share(jobs: list[JobProfile], cands: _Candidates, taken: set[str]) -> tuple[dict, dict]:
    """Jobs of equal priority that cannot all be met share what is left: the job whose need is least
    covered takes its next worker — the cheapest qualifying one, then live near-misses closest to fresh
    — until each is met or nothing is left. Taken in order, the oldest job would take every worker and
    the others none (or, where a job's slack is short, only workers too slow for it are left)."""
    used = set(taken)
    chosen = {j.job_id: [p for p in cands.fresh[j.job_id] if p.locked and p.worker.worker_id not in used]
              for j in jobs}
    used |= {p.worker.worker_id for ps in chosen.values() for p in ps}
    demand = {j.job_id: required_throughput(j) for j in jobs}
    have = {j: sum(p.mu for p in ps) for j, ps in chosen.items()}
    pools = {j.job_id: sorted((p for p in cands.fresh[j.job_id] if not p.locked),
                              key=lambda p: (p.cost / p.mu, p.cost, p.worker.worker_id))
             + sorted(cands.stale[j.job_id], key=lambda p: (p.q.latency_s, p.cost / p.mu, p.worker.worker_id))
             for j in jobs}
    while True:
        for pool in pools.values():
            pool[:] = [p for p in pool if p.worker.worker_id not in used]
        short = [j for j in demand if have[j] < demand[j] * (1 - _TOL) and pools[j]]
        if not short:
            break
        job_id = min(short, key=lambda j: (have[j] / demand[j], j))
        pair = pools[job_id].pop(0)
        chosen[job_id].append(pair)
        have[job_id] += pair.mu
        used.add(pair.worker.worker_id)
    note = f"fair share: {len(jobs)} jobs of equal priority split the workers by the share of their need met"
    return chosen, {j.job_id: note if have[j.job_id] < demand[j.job_id] * (1 - _TOL) else "fair share (met)"
                    for j in jobs}


def _lp_bound(pairs: list[_Pair], demand: float) -> float:
    """Cheapest fractional cover of the demand (LP relaxation): no set of workers costs less."""
    total, have = 0.0, 0.0
    for p in sorted(pairs, key=lambda p: p.worker.price_per_h / p.mu):
        if have >= demand:
            break
        take = min(1.0, (demand - have) / p.mu)
        total += take * p.worker.price_per_h
        have += take * p.mu
    return total if have >= demand * (1 - _TOL) else float("inf")


def _current_sets(jobs: list[JobProfile], cands: _Candidates, config: SolverConfig) -> dict | None:
    """The sets serving each job now (minus workers that no longer qualify), or None when one of
    them is more than `drift` short of its rule."""
    current = {j.job_id: [p for p in cands.fresh[j.job_id] if p.serving] for j in jobs}
    for job in jobs:
        if sum(p.mu for p in current[job.job_id]) < required_throughput(job) * (1 - config.drift):
            return None
    return current if any(current.values()) else None


def _keep_note(kept: float, best: float, config: SolverConfig, bound: bool) -> str:
    saving = max(0.0, 1 - best / kept) if kept else 0.0
    what = "no set is" if bound else "the re-solved set is"
    return f"kept current set ({what} more than {config.keep_bias:.0%} cheaper: {saving:.1%})"


# ---------------------------------------------------------------- decide


def decide(
    jobs: Sequence[JobProfile],
    workers: Sequence[WorkerProfile],
    now: float,
    state: SolverState | None = None,
    config: SolverConfig | None = None,
) -> Decision:
    """One reconcile step: keep the previous set, or re-solve it when a trigger fires.

    `jobs` are the running jobs, `workers` every known worker (dead ones with alive=False);
    `state` is the previous decision's `state` (None the first time). Persist the returned
    `decision.state` and apply `decision.assignment` (worker_id -> job_id; absent: inactive).
    """
    config = config or SolverConfig()
    started = time.perf_counter()
    jobs = sort_jobs(jobs)
    workers = list(workers)
    trigger = resolve_trigger(jobs, workers, now, state, config)
    if trigger is None and state is not None:
        return _keep(jobs, workers, now, state, config, started)
    state = state or SolverState()
    cands = _candidates(jobs, workers, now, state, config)
    # Set-level hysteresis: noisy inputs re-solve often, and near-equal sets must not swap each
    # time. Keep the current sets while they cover their rules within `drift` unless another
    # set is more than `keep_bias` cheaper; the LP bound settles most cases without a MILP.
    current = _current_sets(jobs, cands, config) if config.method != "all" else None
    if current is not None:
        kept = sum(p.worker.price_per_h for ps in current.values() for p in ps)
        bound = sum(_lp_bound(cands.fresh[j.job_id], required_throughput(j)) for j in jobs)
        if bound >= kept * (1 - config.keep_bias):
            note = _keep_note(kept, bound, config, bound=True)
            return _record(jobs, workers, now, state, config, trigger or "", started, cands, current,
                           {j.job_id: note for j in jobs})  # fmt: skip
    chosen, notes = _select(jobs, cands, config)
    if current is not None:
        best = sum(p.worker.price_per_h for ps in chosen.values() for p in ps)
        if best >= kept * (1 - config.keep_bias):
            chosen, notes = current, {j.job_id: _keep_note(kept, best, config, bound=False) for j in jobs}
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
    workers: list[WorkerProfile],
    now: float,
    state: SolverState,
    config: SolverConfig,
    started: float,
) -> Decision:
    by_id = {w.worker_id: w for w in workers}
    allocations = []
    for job in jobs:
        assigned = [by_id[w] for w, j in sorted(state.assignment.items()) if j == job.job_id]
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
        tuple(jobs), tuple(workers), time.perf_counter() - started,
    )  # fmt: skip


# ---------------------------------------------------------------- explanations


def _skip_kind(reason: str) -> str:
    for prefix, kind in (("T_bcast", "freshness"), ("VRAM", "VRAM"), ("backend", "backend")):
        if reason.startswith(prefix):
            return kind
    return "liveness" if reason == "not alive" else "other"


def _infeasible_reason(job: JobProfile, have: float, cands: _Candidates) -> str:
    kinds: dict[str, int] = {}
    for per_job in cands.skipped.values():
        if job.job_id in per_job:
            kind = _skip_kind(per_job[job.job_id])
            kinds[kind] = kinds.get(kind, 0) + 1
    excluded = ", ".join(f"{n} by {k}" for k, n in sorted(kinds.items()))
    return (
        f"infeasible: qualifying throughput {have:.2f} rollouts/s < needed {required_throughput(job):.2f} "
        f"(R={job.rollouts_per_step}, T_train={job.t_train_s:g}s, h={job.headroom:g})"
        + (f"; excluded: {excluded}" if excluded else "")
        + "; best partial set"
    )


def _activate_reason(p: _Pair, note: str, rank: int) -> str:
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


def _record(
    jobs: list[JobProfile],
    workers: list[WorkerProfile],
    now: float,
    state: SolverState,
    config: SolverConfig,
    trigger: str,
    started: float,
    cands: _Candidates,
    chosen: dict[str, list[_Pair]],
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
        slack = config.drift if notes[job.job_id].startswith("kept current set") else _TOL
        feasible = have >= required_throughput(job) * (1 - slack)
        if not feasible:
            infeasible.append(job.job_id)
        reason = "meets the capacity rule" if feasible else _infeasible_reason(job, have, cands)
        if feasible and have < required_throughput(job) * (1 - _TOL):
            reason = f"within {config.drift:.0%} of the capacity rule ({have:.2f}/{required_throughput(job):.2f})"
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
                why = why or ("still chosen" if p.q.ok else _activate_reason(p, notes[job.job_id], rank))
                lines.append(WorkerDecision(wid, Action.KEEP, job.job_id, why))
            else:
                activated_at[wid] = now
                why = _activate_reason(p, notes[job.job_id], rank)
                lines.append(WorkerDecision(wid, Action.ACTIVATE, job.job_id, why))
    lines += _unassigned_lines(jobs, workers, state, cands, assignment)
    lines = [replace(line, others=_others(line, jobs, cands)) for line in lines]
    new_state = SolverState(
        assignment, activated_at, qualified, now, _fingerprint(jobs, workers), infeasible
    )  # fmt: skip
    parts = [f"{j}: {n}" for j, n in notes.items()]
    method = "; ".join(parts) if len(parts) > 1 else next(iter(notes.values()), "")
    return Decision(
        now, trigger, True, method, tuple(allocations), tuple(lines), new_state,
        tuple(jobs), tuple(workers), time.perf_counter() - started,
    )  # fmt: skip


def _others(line: WorkerDecision, jobs: list[JobProfile], cands: _Candidates) -> tuple[tuple[str, Action, str], ...]:
    """Why the worker of this line does not serve each running job other than its own."""
    skipped = cands.skipped.get(line.worker_id, {})
    out = []
    for job in jobs:
        if job.job_id == line.job_id:
            continue
        if job.job_id in skipped:
            out.append((job.job_id, Action.SKIP, skipped[job.job_id]))
        elif line.job_id is not None:
            out.append((job.job_id, Action.SKIP, f"serves job {line.job_id} (one job at a time)"))
        else:
            out.append((job.job_id, Action.IDLE, "qualifies but not needed (rule met by cheaper workers)"))
    return tuple(out)


def _unassigned_lines(
    jobs: list[JobProfile],
    workers: list[WorkerProfile],
    state: SolverState,
    cands: _Candidates,
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
        reasons = cands.skipped.get(wid, {})
        if before is not None:
            if before not in running:
                why = f"job {before} no longer running"
            elif before in reasons:
                why = f"no longer qualifies: {reasons[before]}"
            else:
                why = "a cheaper set meets the rule without it"
            lines.append(WorkerDecision(wid, Action.DEACTIVATE, None, why))
        elif wid in candidates:
            lines.append(
                WorkerDecision(wid, Action.IDLE, None, "qualifies but not needed (rule met by cheaper workers)")
            )
        else:
            distinct = set(reasons.values())
            why = distinct.pop() if len(distinct) == 1 else "; ".join(f"{j}: {r}" for j, r in reasons.items())
            why = why or "no running job"
            lines.append(WorkerDecision(wid, Action.SKIP, None, why))
    return lines
