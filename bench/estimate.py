"""A job's estimated cost against what it then cost: the demo's job on the tiny model, through the whole
platform, estimated before it is submitted. The goal: within ±25 % of the actual cost.

    python bench/estimate.py                       # 20-step job first, then the demo's 130 steps
    python bench/estimate.py --steps 60 --calibration-steps 10

The platform runs as `echo2-server up` runs it (server/stack.py: private Redis, the API, the Celery
scheduler, a learner host, 2 local CPU workers at $0.05/h; the learner at the default $2/h). An estimate
takes learner time from earlier jobs like the one asked about (api/services/estimate.py), and a fresh platform
has none, so: the demo job is estimated on the empty platform (the scheduler's default T_train), then a
shorter job of the same spec runs (as a user's first, shorter try would), then the demo job is estimated
again, submitted (it keeps that estimate) and run to its end. Printed: both estimates, the actual cost
(the job's ledger, read a few ticks after it ended so its last rollouts are paid), their ratios, and the
estimate's learner seconds per step, startup and wall time against the job's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SETTLE_S = 8.0  # after a job ends: a few scheduler ticks, so its last rollouts are paid


def main() -> None:
    args = _parse()
    from echo2 import Client

    from api.settings import Settings
    from server.demo import demo_spec
    from server.local import free_port
    from server.stack import Stack, exit_on_sigterm

    work = Path(tempfile.mkdtemp(prefix="echo2-estimate-"))
    exit_on_sigterm()
    started = time.monotonic()
    stack = Stack(Settings(data_dir=work / ".echo2", port=free_port()), workers=args.workers).start()
    try:
        with Client(base_url=stack.url, api_key=stack.admin_key, timeout=120) as client:
            _wait_for_workers(client, args.workers)
            spec = demo_spec("tiny", args.steps, args.staleness)
            cold = client.jobs.estimate(spec)
            _run(client, {**spec, "name": "calibration", "max_steps": args.calibration_steps})
            warm = client.jobs.estimate(spec)
            job, wall_s = _run(client, spec)
            ledger = client.jobs.ledger(job.id, limit=1)
            report = client.jobs.report(job.id)
    finally:
        stack.stop()
    _print(args, cold, warm, job, ledger, report, wall_s, time.monotonic() - started)


def _wait_for_workers(client: Any, n: int, timeout_s: float = 120.0) -> None:
    """Estimates count the live fleet: start once every local worker has registered."""
    deadline = time.monotonic() + timeout_s
    while client.workers.list(status="idle").total < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {n} workers registered in {timeout_s:.0f} s")
        time.sleep(1.0)


def _run(client: Any, spec: dict[str, Any]) -> tuple[Any, float]:
    start = time.monotonic()
    job = client.jobs.create(spec)
    while not client.jobs.get(job.id).status.is_terminal():
        time.sleep(1.0)
    wall_s = time.monotonic() - start
    time.sleep(SETTLE_S)
    job = client.jobs.get(job.id)
    if job.status.value != "succeeded":
        raise RuntimeError(f"job {job.id} {job.status.value}: {job.status_reason}")
    return job, wall_s


def _print(args: argparse.Namespace, cold: Any, warm: Any, job: Any, ledger: Any, report: Any, wall_s: float,
           total_s: float) -> None:
    actual = ledger.total_usd
    learner_s = next((t.seconds for t in ledger.by_kind if t.key == "learner"), 0.0)
    print(f"demo job on the tiny model: {args.steps} steps, S={args.staleness}, {args.workers} local workers; "
          f"{args.calibration_steps}-step job of the same spec before it")
    print(f"{'':34} {'estimate':>10} {'actual':>10} {'ratio':>7}")
    for name, e in (("on the empty platform", cold), ("after the shorter job (kept)", warm)):
        print(f"{name:34} ${e.cost_usd:>9.4f} ${actual:>9.4f} {e.cost_usd / actual:>7.3f}")
    print(f"{'stored on the job (report)':34} ${report.estimate_usd:>9.4f} ${report.cost_usd:>9.4f} "
          f"{report.estimate_usd / report.cost_usd:>7.3f}")
    cost = job.cost
    print(f"actual: learner ${cost.learner_usd:.4f} ({learner_s:.0f} s billed), workers ${cost.workers_usd:.4f}; "
          f"ledger total ${actual:.4f} = job cost ${cost.total_usd:.4f}")
    for name, e in (("empty platform", cold), ("after the shorter job", warm)):
        print(f"estimate ({name}): T_train {e.t_train_s:.3f} s + overhead {e.step_overhead_s:.3f} s, R/Σμ "
              f"{e.rollouts_per_step / e.throughput if e.throughput else float('nan'):.3f} s -> step {e.step_s:.3f} s; "
              f"startup {e.startup_s:.1f} s; wall {e.wall_s:.0f} s; learner ${e.learner_usd:.4f}, "
              f"{len(e.workers)} workers ${e.workers_usd:.4f}")
    print(f"actual: {wall_s:.0f} s from submission to the end; learner busy {report.learner_busy_s:.0f} s of "
          f"{report.learner_wall_s:.0f} s; bench wall time {total_s:.0f} s")
    for line in warm.assumptions:
        print(f"  - {line}")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=130, help="steps of the demo job (the demo's own default)")
    p.add_argument("--calibration-steps", type=int, default=20, help="steps of the shorter job run first")
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    return p.parse_args()


if __name__ == "__main__":
    main()
