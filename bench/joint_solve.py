"""Decision time of several jobs on one large fleet: the scheduler's `decide` (planner/solver.py) on random
workers, one job alone and several together (the joint MILP, planner/selection.py), with its method and cost.

    python bench/joint_solve.py                    # 10,000 workers; 1, 2 and 4 jobs
    python bench/joint_solve.py --workers 5000 --jobs 1,3,8

The workers are drawn as a review's test drew them (seeded): μ 0.2-3 groups/s, 24 GB, price $0.05-1/h,
T_bcast 0.5-3 s, T_gen 0-2 s; each job asks 64 groups a step at T_train 20 s, S = 2.
"""

from __future__ import annotations

import argparse
import random
import time

from planner.capacity import JobProfile, WorkerProfile
from planner.solver import decide


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=10_000)
    parser.add_argument("--jobs", default="1,2,4", help="comma-separated job counts")
    args = parser.parse_args()
    rng = random.Random(0)
    workers = [WorkerProfile(f"w{i}", rng.uniform(0.2, 3.0), 24, frozenset(), rng.uniform(0.05, 1.0),
                             rng.uniform(0.5, 3.0), rng.uniform(0.0, 2.0)) for i in range(args.workers)]
    for k in (int(x) for x in args.jobs.split(",")):
        jobs = [JobProfile(f"j{i}", 64, 20.0, 2, submitted_at=float(i)) for i in range(k)]
        start = time.perf_counter()
        d = decide(jobs, workers, 0.0)
        wall = time.perf_counter() - start
        methods = sorted({m.split(": ", 1)[-1] for m in d.method.split("; ")})
        print(f"{k} jobs on {args.workers:,} workers: solve {d.solve_s:.2f} s (wall {wall:.2f} s), "
              f"${sum(a.price_per_h for a in d.jobs):.2f}/h, all feasible {all(a.feasible for a in d.jobs)}, "
              f"method {methods}")


if __name__ == "__main__":
    main()
