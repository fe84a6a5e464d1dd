"""Set selection: the candidate pairs (worker, job), and the cheapest set for each job — one joint MILP,
greedy by price/μ, the best partial set, a fair share among jobs of equal priority."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from heapq import heappush, heappushpop
from itertools import accumulate

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from .capacity import JobProfile, Miss, Qualification, WorkerProfile, qualify, required_throughput
from .decision import SolverConfig, SolverState

TOL = 1e-9
NO_DEMAND = "no demand"


@dataclass(slots=True)
class Pair:
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
class Candidates:
    fresh: dict[str, list[Pair]]  # job -> pairs meeting every constraint
    stale: dict[str, list[Pair]]  # job -> live pairs that miss only freshness
    skipped: dict[str, dict[str, Qualification]]  # worker -> job -> why it does not qualify


def candidates(
    jobs: list[JobProfile], workers: Sequence[WorkerProfile], now: float, state: SolverState, config: SolverConfig
) -> Candidates:
    fresh: dict[str, list[Pair]] = {j.job_id: [] for j in jobs}
    stale: dict[str, list[Pair]] = {j.job_id: [] for j in jobs}
    skipped: dict[str, dict[str, Qualification]] = {}
    locked_to: dict[str, str] = {}
    for w in workers:
        current = state.assignment.get(w.worker_id)
        for job in jobs:
            on_job = current == job.job_id
            q = qualify(w, job)
            cost = w.price_per_h * (1 - config.keep_bias) if on_job else w.price_per_h
            dwell = now - state.activated_at.get(w.worker_id, now)
            pair = Pair(w, job, q, cost, on_job and q.ok and dwell < config.min_dwell_s, on_job)
            if q.ok:
                fresh[job.job_id].append(pair)
                if pair.locked:
                    locked_to[w.worker_id] = job.job_id
                continue
            skipped.setdefault(w.worker_id, {})[job.job_id] = q
            if q.kind is Miss.freshness:
                stale[job.job_id].append(pair)
    for table in (fresh, stale):  # a worker locked to one job is not a candidate for the others
        for job_id, ps in table.items():
            table[job_id] = [p for p in ps if locked_to.get(p.worker.worker_id, job_id) == job_id]
    return Candidates(fresh, stale, skipped)


def _greedy(pairs: list[Pair], demand: float) -> list[Pair]:
    """Cheapest per rollout first until the demand is met, then drop what became redundant."""
    chosen = [p for p in pairs if p.locked]
    have = sum(p.mu for p in chosen)
    for p in sorted((p for p in pairs if not p.locked), key=lambda p: (p.cost / p.mu, p.cost, p.worker.worker_id)):
        if have >= demand * (1 - TOL):
            break
        chosen.append(p)
        have += p.mu
    return _drop_redundant(chosen, demand) if have >= demand * (1 - TOL) else chosen


def _drop_redundant(chosen: list[Pair], demand: float) -> list[Pair]:
    """The set less each worker (not held by its dwell time) the others meet the demand without: dearest first,
    and of equal price the slowest first, so that few are left. Every set of $0/h workers (a worker's default
    price) costs the same, so the MILP returns any set meeting the demand, e.g. seven where three do."""
    kept = list(chosen)
    have = sum(p.mu for p in kept)
    for p in sorted(kept, key=lambda p: (-p.cost, p.mu)):
        if not p.locked and have - p.mu >= demand * (1 - TOL):
            kept.remove(p)
            have -= p.mu
    return kept


def _milp(pairs: list[Pair], demands: dict[str, float], config: SolverConfig) -> tuple[list[Pair] | None, str]:
    """min Σ cost·x  s.t.  Σ_i μ_ij x_ij ≥ D_j per job,  Σ_j x_ij ≤ 1 per worker,  x binary; then each job's set
    less the workers it meets D_j without (it costs no more: prices are ≥ 0)."""
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
    chosen = [p for job_id, demand in demands.items()
              for p in _drop_redundant([p for p in chosen if p.job.job_id == job_id], demand)]
    return chosen, "milp" if res.status == 0 else f"milp (best found: {res.message})"


def _can_beat(pairs: list[Pair], demand: float, upper: float) -> list[Pair]:
    """The pairs that can be in a set meeting `demand` for at most `upper` (LP reduced-cost fixing; exact).
    The LP relaxation takes the best cost per rollout first; with λ its price of a rollout/s (the ratio of
    the pair it takes in part) and L its bound, a set holding pair i costs at least L + cost_i − λ·μ_i.
    On a large fleet most workers are priced far above λ: HiGHS's presolve alone took 15-32 s on the
    ~7,700 candidates of 10,000 workers, against a 5 s time limit."""
    relaxed = _relaxation(pairs, demand)
    if relaxed is None:
        return pairs  # even every pair falls short: nothing to fix
    price, bound = relaxed
    locked = np.array([p.locked for p in pairs], dtype=bool)
    mu, cost = np.array([p.mu for p in pairs]), np.array([p.cost for p in pairs])
    keep = locked | (cost - price * mu <= upper - bound + 1e-9 * max(1.0, upper))
    return [p for p, ok in zip(pairs, keep.tolist(), strict=True) if ok]


def _relaxation(pairs: list[Pair], demand: float) -> tuple[float, float] | None:
    """The LP relaxation's price of a rollout/s (λ) and its bound (L: no set meeting `demand` costs less, the
    locked pairs included), or None where every pair together falls short."""
    locked = [p.locked for p in pairs]
    mu = np.array([p.mu for p in pairs])
    cost = np.array([p.cost for p in pairs])
    need = demand - mu[locked].sum()
    price, bound = 0.0, float(cost[locked].sum())
    if need > 0:
        free = np.flatnonzero(~np.array(locked, dtype=bool))
        order = free[np.argsort(cost[free] / mu[free], kind="stable")]
        covered = np.cumsum(mu[order])
        k = int(np.searchsorted(covered, need))  # whole pairs order[:k], then part of order[k]
        if k == len(order):
            return None
        price = cost[order[k]] / mu[order[k]]
        bound += cost[order[:k]].sum() + (need - (covered[k - 1] if k else 0.0)) * price
    return price, bound


def _joint_columns(jobs: list[JobProfile], cands: Candidates, demands: dict[str, float]) -> list[Pair]:
    """The pairs that can be in a joint set costing no more than one found at once (each job's greedy set from
    the workers the jobs before it left): the joint MILP over every pair of 10,000 workers and two jobs ran out
    its time limit where each job's pruned MILP took 0.1 s. Exact, as for one job: job j's part of such a set
    meets its demand for at most that cost less the other jobs' LP bounds (_can_beat), and a pair that more
    others are as cheap and as fast as than the whole set can hold is never needed (_undominated)."""
    fresh = {j.job_id: cands.fresh[j.job_id] for j in jobs}
    everything = [p for ps in fresh.values() for p in ps]
    used: set[str] = set()
    upper = 0.0
    for job_id, pairs in fresh.items():
        free = [p for p in pairs if p.worker.worker_id not in used]
        greedy = _greedy(free, demands[job_id])
        if sum(p.mu for p in greedy) < demands[job_id] * (1 - TOL):
            return everything  # no set found at once: nothing to prune against
        upper += sum(p.cost for p in greedy)
        used |= {p.worker.worker_id for p in greedy}
    relaxed = {job_id: _relaxation(pairs, demands[job_id]) for job_id, pairs in fresh.items()}
    bounds = {job_id: r[1] if r is not None else 0.0 for job_id, r in relaxed.items()}
    most = _most_pairs(everything, upper)
    return [p for job_id, pairs in fresh.items()
            for p in _undominated(_can_beat(pairs, demands[job_id], upper - sum(bounds.values()) + bounds[job_id]),
                                  upper, most)]


def _most_pairs(pairs: list[Pair], upper: float) -> int:
    """The most pairs a set costing at most `upper` can hold."""
    return bisect_right(list(accumulate(sorted(p.cost for p in pairs))), upper * (1 + 1e-9))


def _undominated(pairs: list[Pair], upper: float, most: int | None = None) -> list[Pair]:
    """Drops a pair that m others are at least as cheap and as fast as, m being the most pairs a set costing
    at most `upper` can hold (`most`, where the set may hold other jobs' pairs too): such a set can swap it for
    one of them it lacks and cost no more, so the cheapest set is still among the rest (the first m pairs
    dominating any pair are kept themselves)."""
    m = _most_pairs(pairs, upper) if most is None else most
    if m == 0:
        return pairs
    fastest: list[float] = []  # the m largest μ among the pairs seen so far (a min-heap)
    keep = [True] * len(pairs)
    # cheapest first, then fastest: a pair can only be dominated by pairs before it, never by itself
    for i in sorted(range(len(pairs)), key=lambda i: (pairs[i].cost, -pairs[i].mu, i)):
        mu = pairs[i].mu
        if len(fastest) == m:
            keep[i] = pairs[i].locked or fastest[0] < mu
            heappushpop(fastest, mu)
        else:
            heappush(fastest, mu)
    return [p for p, ok in zip(pairs, keep, strict=True) if ok]


def _best_partial(fresh: list[Pair], stale: list[Pair], demand: float) -> list[Pair]:
    """Every qualifying worker, then live near-misses closest to fresh until the demand is met."""
    chosen = list(fresh)
    have = sum(p.mu for p in chosen)
    for p in sorted(stale, key=lambda p: (p.q.latency_s, p.cost / p.mu, p.worker.worker_id)):
        if have >= demand * (1 - TOL):
            break
        chosen.append(p)
        have += p.mu
    return chosen


def _solve_job(job_id: str, fresh: list[Pair], stale: list[Pair], demand: float,
               config: SolverConfig) -> tuple[list[Pair], str]:
    """Cheapest set for one job; the best partial set when even every qualifying worker is short. A job that
    needs nothing (a Tinker model nobody samples) keeps only the workers its dwell time holds."""
    if config.method == "all":
        return fresh + stale, "all"
    if demand <= 0:
        return [p for p in fresh if p.locked], NO_DEMAND
    if sum(p.mu for p in fresh) < demand * (1 - TOL):
        return _best_partial(fresh, stale, demand), "partial"
    greedy = _greedy(fresh, demand)
    if config.method == "greedy":
        return greedy, "greedy"
    upper = sum(p.cost for p in greedy)
    columns = _undominated(_can_beat(fresh, demand, upper), upper)
    chosen, note = _milp(columns, {job_id: demand}, config)
    if chosen is None:
        return greedy, f"greedy (fallback: {note})"
    if sum(p.cost for p in greedy) < sum(p.cost for p in chosen) - TOL:  # MILP stopped early
        return greedy, f"greedy (cheaper than {note})"
    return chosen, note


def select(jobs: list[JobProfile], cands: Candidates, config: SolverConfig) -> tuple[dict, dict]:
    chosen: dict[str, list[Pair]] = {}
    notes: dict[str, str] = {}
    if config.method == "milp" and len(jobs) > 1:
        demands = {j.job_id: required_throughput(j) for j in jobs}
        joint, note = _milp(_joint_columns(jobs, cands, demands), demands, config)
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


def _take_in_order(jobs: list[JobProfile], cands: Candidates, config: SolverConfig,
                   taken: set[str]) -> tuple[dict, dict]:
    """Each job, oldest first, takes the cheapest set its rule needs from what is left."""
    chosen: dict[str, list[Pair]] = {}
    notes: dict[str, str] = {}
    used = set(taken)
    for job in jobs:
        fresh = [p for p in cands.fresh[job.job_id] if p.worker.worker_id not in used]
        stale = [p for p in cands.stale[job.job_id] if p.worker.worker_id not in used]
        chosen[job.job_id], notes[job.job_id] = _solve_job(job.job_id, fresh, stale, required_throughput(job), config)
        used |= {p.worker.worker_id for p in chosen[job.job_id]}
    return chosen, notes


def _fair_share(jobs: list[JobProfile], cands: Candidates, taken: set[str]) -> tuple[dict, dict]:
    """Jobs of equal priority that cannot all be met share what is left: the job whose need is least
    covered takes its next worker — the cheapest qualifying one, then live near-misses closest to fresh
    — until each is met or nothing is left (a worker fresh for a job it can help meet is not another's
    near-miss before that). Taken in order, the oldest job would take every worker and
    the others none (or, where a job's slack is short, only workers too slow for it are left)."""
    used = set(taken)
    chosen = {j.job_id: [p for p in cands.fresh[j.job_id] if p.locked and p.worker.worker_id not in used]
              for j in jobs}
    used |= {p.worker.worker_id for ps in chosen.values() for p in ps}
    demand = {j.job_id: required_throughput(j) for j in jobs}
    have = {j: sum(p.mu for p in ps) for j, ps in chosen.items()}
    fresh = {j.job_id: sorted((p for p in cands.fresh[j.job_id] if not p.locked and p.worker.worker_id not in used),
                              key=lambda p: (p.cost / p.mu, p.cost, p.worker.worker_id)) for j in jobs}
    near = {j.job_id: sorted(cands.stale[j.job_id], key=lambda p: (p.q.latency_s, p.cost / p.mu, p.worker.worker_id))
            for j in jobs}
    # A worker fresh for a job its qualifying workers can meet is no other job's near-miss until that job is
    # served: a job no worker is fresh for, ranked least met, took as near-misses the workers another job
    # qualified them for and could be met with.
    coverable = {j for j, ps in fresh.items() if have[j] + sum(p.mu for p in ps) >= demand[j] * (1 - TOL)}
    spoken = {j: {p.worker.worker_id for k in coverable - {j} for p in fresh[k]} for j in demand}
    _share_out({j: fresh[j] + [p for p in near[j] if p.worker.worker_id not in spoken[j]] for j in demand},
               chosen, have, demand, used)
    _share_out({j: fresh[j] + near[j] for j in demand}, chosen, have, demand, used)
    note = f"fair share: {len(jobs)} jobs of equal priority split the workers by the share of their need met"
    return chosen, {j.job_id: note if have[j.job_id] < demand[j.job_id] * (1 - TOL) else "fair share (met)"
                    for j in jobs}


def _share_out(pools: dict[str, list[Pair]], chosen: dict[str, list[Pair]], have: dict[str, float],
               demand: dict[str, float], used: set[str]) -> None:
    """The job whose need is least covered takes the next pair of its pool, until each is met or its pool empty."""
    while True:
        for pool in pools.values():
            pool[:] = [p for p in pool if p.worker.worker_id not in used]
        short = [j for j in demand if have[j] < demand[j] * (1 - TOL) and pools[j]]
        if not short:
            return
        job_id = min(short, key=lambda j: (have[j] / demand[j], j))
        pair = pools[job_id].pop(0)
        chosen[job_id].append(pair)
        have[job_id] += pair.mu
        used.add(pair.worker.worker_id)


def lp_bound(pairs: list[Pair], demand: float) -> float:
    """Cheapest fractional cover of the demand (LP relaxation): no set of workers costs less."""
    total, have = 0.0, 0.0
    for p in sorted(pairs, key=lambda p: p.worker.price_per_h / p.mu):
        if have >= demand:
            break
        take = min(1.0, (demand - have) / p.mu)
        total += take * p.worker.price_per_h
        have += take * p.mu
    return total if have >= demand * (1 - TOL) else float("inf")


def current_sets(jobs: list[JobProfile], cands: Candidates, config: SolverConfig) -> dict | None:
    """The sets serving each job now (minus workers that no longer qualify, and those the rest meet its rule
    without: a set of $0/h workers costs no more than the LP bound, however many it holds), or None when one
    of them is more than `drift` short of its rule."""
    current = {j.job_id: [p for p in cands.fresh[j.job_id] if p.serving] for j in jobs}
    for job in jobs:
        if sum(p.mu for p in current[job.job_id]) < required_throughput(job) * (1 - config.drift):
            return None
        current[job.job_id] = _drop_redundant(current[job.job_id], required_throughput(job))
    return current if any(current.values()) else None
