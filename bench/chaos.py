"""Chaos in one job: workers SIGKILLed again and again at random points, the learner once, the API process
once (restarted), Redis once — and the job still completes with nothing lost and nothing trained twice.

    python bench/chaos.py                    # 20 worker kills, 60 steps, 3 workers
    python bench/chaos.py --worker-kills 5 --steps 30

The whole platform runs as `echo2-server up` runs it (server/stack.py: private Redis, the API, the Celery
scheduler, a learner host, N local CPU workers, each its own process group), with the demo's job on the
tiny model (S = 2). A supervisor restarts what died, as a process manager would. Kills land at random
times (seeded) while the job trains: each worker kill SIGKILLs a random worker's whole process group
(its relay and any generation in flight go with it); once each, and spread over the run: the learner
host (its learner dies inside the Celery task; the scheduler relaunches it), the API (its in-flight
requests are lost; workers and the learner retry), and Redis (stopped and started: the broker and the
tick lock).

Checked afterwards from the API's records only (the SDK, as the job's owner would): the job
succeeded at its last step; every prompt is in a state it can be trained from (0 lost); every trained
rollout names one step, and no (prompt, epoch) was trained by two rollouts (0 trained twice); every
step of the job trained something; published versions strictly increase in creation order.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from echo2.client import every

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@dataclass
class Chaos:
    worker_kills: int = 0
    learner_kills: int = 0
    api_restarts: int = 0
    redis_restarts: int = 0
    events: list[str] = field(default_factory=list)


def main() -> int:
    args = _parse()
    from echo2 import Client

    from api.settings import Settings
    from server.demo import demo_spec
    from server.local import free_port
    from server.stack import Stack, exit_on_sigterm

    os.environ.update({"ECHO2_LEASE_TTL_S": "8", "ECHO2_WORKER_OFFLINE_AFTER_S": "5",
                       "ECHO2_LEARNER_DEAD_AFTER_S": "6", "ECHO2_LOG_LEVEL": "WARNING"})
    work = Path(tempfile.mkdtemp(prefix="echo2-chaos-"))
    exit_on_sigterm()
    stack = Stack(Settings(data_dir=work / ".echo2", port=free_port()), workers=args.workers).start()
    rng, chaos = random.Random(args.seed), Chaos()
    started = time.monotonic()
    try:
        with Client(base_url=stack.url, api_key=stack.admin_key, timeout=60, max_retries=20) as client:
            job = client.jobs.create(demo_spec("tiny", args.steps, args.staleness))
            _run(client, stack, job.id, args, rng, chaos)
            report = _check(client, job.id)
    finally:
        stack.stop()
    _print(args, chaos, report, time.monotonic() - started, work)
    return 0 if report["ok"] else 1


def _run(client, stack, job_id: str, args: argparse.Namespace, rng: random.Random, chaos: Chaos) -> None:  # type: ignore[no-untyped-def]
    """Kill things while the job trains: the one-off kills at fixed fractions of the run, worker kills
    at random gaps, until the job ends."""
    once = {round(args.steps * 0.3): _kill_learner, round(args.steps * 0.5): _restart_api,
            round(args.steps * 0.7): _restart_redis}
    next_worker_kill = time.monotonic() + rng.uniform(1, 2 * args.mean_gap_s)
    while True:
        step = _job_step(client, job_id, stack)
        if step is None:
            return
        for at in [a for a in once if step >= a]:
            once.pop(at)(stack, chaos)
        if chaos.worker_kills < args.worker_kills and time.monotonic() >= next_worker_kill:
            _kill_worker(stack, rng, chaos)
            next_worker_kill = time.monotonic() + rng.uniform(0.2, 2 * args.mean_gap_s)
        stack.supervise(max_restarts=10**6)
        time.sleep(0.2)


def _job_step(client, job_id: str, stack) -> int | None:  # type: ignore[no-untyped-def]
    """The job's step, or None once it ended; rides out an API that is down (being restarted)."""
    from echo2 import errors

    for _ in range(300):
        try:
            job = client.jobs.get(job_id)
            return None if job.status.is_terminal() else job.step
        except errors.ConnectionError:
            stack.supervise(max_restarts=10**6)
            time.sleep(0.5)
    raise RuntimeError("the API did not come back within 150 s")


def _kill_worker(stack, rng: random.Random, chaos: Chaos) -> None:  # type: ignore[no-untyped-def]
    victim = rng.choice([c for c in stack.children if c.name.startswith("worker-")])
    _kill(victim)
    chaos.worker_kills += 1
    chaos.events.append(f"SIGKILL {victim.name}")


def _kill_learner(stack, chaos: Chaos) -> None:  # type: ignore[no-untyped-def]
    _kill(next(c for c in stack.children if c.name == "learner-host"))
    chaos.learner_kills += 1
    chaos.events.append("SIGKILL learner-host (and the learner in it)")


def _restart_api(stack, chaos: Chaos) -> None:  # type: ignore[no-untyped-def]
    _kill(next(c for c in stack.children if c.name == "api"))
    chaos.api_restarts += 1
    chaos.events.append("SIGKILL api (restarted by the supervisor)")


def _restart_redis(stack, chaos: Chaos) -> None:  # type: ignore[no-untyped-def]
    stack.redis.stop()
    stack.redis.start()
    chaos.redis_restarts += 1
    chaos.events.append("Redis stopped and started")


def _kill(child) -> None:  # type: ignore[no-untyped-def]
    if child.proc is not None and child.proc.poll() is None:
        os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait()


def _check(client, job_id: str) -> dict:  # type: ignore[no-untyped-def]
    job = client.jobs.get(job_id)
    prompts = every(lambda offset: client.jobs.prompts(job_id, limit=200, offset=offset))
    rollouts = every(lambda offset: client.jobs.rollouts(job_id, limit=200, offset=offset))
    versions = client.checkpoints.versions(job_id)
    trained = [r for r in rollouts if r.status.value == "trained"]
    lost = [p.id for p in prompts if p.state not in ("available", "leased", "submitted", "trained")]
    # A new epoch starts only once every prompt was trained, so a prompt in epoch e was trained once in
    # each earlier epoch, and once more if it is trained in this one.
    times = Counter(r.prompt_id for r in trained)
    owed = {p.id: p.epoch + (p.state == "trained") for p in prompts}
    steps = {r.trained_step for r in trained}
    created = [v.version for v in sorted(versions, key=lambda v: v.created_at)]
    report = {
        "status": job.status.value, "step": job.step, "max_steps": job.spec.max_steps, "prompts": len(prompts),
        "lost": len(lost), "rollouts": len(rollouts), "trained": len(trained),
        "trained_twice": sum(max(0, times[p] - n) for p, n in owed.items()),
        "training_lost": sum(max(0, n - times[p]) for p, n in owed.items()),
        "steps_without_rollouts": len(set(range(job.step)) - steps), "versions": len(versions),
        "versions_increasing": created == sorted(created) and len(set(created)) == len(created),
        "rejected": Counter((r.reason or "").split(":")[0] for r in rollouts if r.status.value == "rejected"),
        "epochs": max((p.epoch for p in prompts), default=0) + 1, "cost_usd": job.cost.total_usd,
    }
    report["ok"] = (report["status"] == "succeeded" and report["step"] == report["max_steps"] and not lost
                    and report["trained_twice"] == 0 and report["versions_increasing"]
                    and report["steps_without_rollouts"] == 0)
    return report


def _print(args: argparse.Namespace, chaos: Chaos, report: dict, wall_s: float, work: Path) -> None:
    print(f"chaos run: {args.steps} steps, S={args.staleness}, {args.workers} workers, seed {args.seed}; "
          f"{wall_s:.0f} s wall; logs in {work / '.echo2' / 'run'}")
    print(f"  injected: {chaos.worker_kills} worker SIGKILLs, {chaos.learner_kills} learner kill, "
          f"{chaos.api_restarts} API restart, {chaos.redis_restarts} Redis restart")
    print(f"  job: {report['status']} at step {report['step']}/{report['max_steps']}, cost ${report['cost_usd']:.4f}")
    print(f"  prompts: {report['prompts']} ({report['epochs']} epochs), lost {report['lost']}")
    print(f"  rollouts: {report['rollouts']} submitted, {report['trained']} trained, "
          f"trained twice {report['trained_twice']}, prompt trainings missing {report['training_lost']}, "
          f"steps without a trained rollout {report['steps_without_rollouts']}")
    print(f"  rejected by reason: {dict(report['rejected'])}")
    print(f"  versions: {report['versions']} published, strictly increasing: {report['versions_increasing']}")
    print("  PASS" if report["ok"] else "  FAIL")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--worker-kills", type=int, default=20)
    parser.add_argument("--mean-gap-s", type=float, default=3.0, help="mean seconds between worker kills")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
