"""A real model learns through the whole platform, measured on problems it never trained on.

    python bench/smollm2_learns.py                       # S = 2, 120 steps, bf16 versions (the default)
    python bench/smollm2_learns.py --staleness 0 --steps 60
    python bench/smollm2_learns.py --dtype float32 --steps 40           # float32 versions at equal steps
    python bench/smollm2_learns.py --rounding dithered --steps 40
    python bench/smollm2_learns.py --correction tis --steps 40          # one correction on (tis, token level)
    python bench/smollm2_learns.py --steps 400 --max-minutes 60         # the curve carried on, stopped at 60 min

`echo2-server up` (server/stack.py: private Redis, the API, the Celery scheduler, a learner host, local
CPU workers) runs the demo's SmolLM2 job (server/demo.py: SMOLLM2_TWO_DIGIT) on SmolLM2-135M-Instruct (the
packaged GGUF, converted once to an HF folder): two-digit addition ("what is 37+45?" with the model's
chat template; 8,100 problems, 20 % of them held out and never trained on), G = 8, 8 prompts per step,
16 new tokens, lr 2e-6, Adam betas 0.9/0.99, bf16 versions (the learner computes on them: learner/rounding.py).
The learner evaluates `--eval-size` held-out problems greedy and sampled at temperature 1 before the first
step, every `--eval-every` steps and after the last (with their standard errors, sqrt(p(1-p)/n)).
Reported: that held-out curve, the training reward and the mismatch between behaviour and learner by blocks
of 10 steps, the bytes of every version (full and delta), and the wall time.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def spec(args: argparse.Namespace) -> dict[str, Any]:
    from server.demo import demo_spec

    job = demo_spec("smollm2", args.steps, args.staleness)
    job["name"] = f"smollm2-two-digit-S{args.staleness}"
    job["eval"] = {"size": args.eval_size, "every": args.eval_every}
    job["grpo"]["lr"] = args.lr
    job["grpo"].update(correction=args.correction, correction_level=args.correction_level,
                       correction_high=args.correction_high, correction_low=args.correction_low)
    job["weights"] = {"dtype": args.dtype} | ({"rounding": args.rounding} if args.rounding else {})
    return job


def run(args: argparse.Namespace) -> None:
    from echo2 import Client

    from api.settings import Settings
    from server.local import free_port
    from server.stack import Stack, exit_on_sigterm
    work = Path(tempfile.mkdtemp(prefix="echo2-smollm2-"))
    exit_on_sigterm()
    # On a machine shared with other work a starved learner or worker can miss a heartbeat, a lease renewal or
    # a delivery for longer than the defaults allow (30 s, 15 s, 60 s, 120 s): relaunch loops ended runs, and a
    # worker deactivated for "no measured throughput" idled for 20 minutes. The bench's stack (its processes
    # read their settings from the environment) waits 10 to 30 minutes instead.
    os.environ.update(ECHO2_LEARNER_DEAD_AFTER_S="600", ECHO2_WORKER_OFFLINE_AFTER_S="600",
                      ECHO2_LEASE_TTL_S="600", ECHO2_DELIVERY_GRACE_S="1800")
    stack = Stack(Settings(data_dir=work / ".echo2", port=free_port()), workers=args.workers).start()
    try:
        with Client(base_url=stack.url, api_key=stack.admin_key, timeout=300) as client:
            start = time.monotonic()
            job = client.jobs.create(spec(args))
            print(f"{job.id}: {args.steps} steps, S={args.staleness}, {args.workers} CPU worker(s)", flush=True)
            seen = 0
            while not _finished(client, job.id):
                seen = _print_evals(client, job.id, seen, start)
                if args.max_minutes and time.monotonic() - start > args.max_minutes * 60:
                    print(f"stopped at {args.max_minutes} minutes", flush=True)
                    client.jobs.cancel(job.id)
                    break
                time.sleep(5)
            _print_evals(client, job.id, seen, start)
            _summary(client, job.id, time.monotonic() - start)
            _versions(client, job.id)
    finally:
        stack.stop()


def _finished(client: Any, job_id: str) -> bool:
    """Whether the job ended; an API too starved to answer (load averages of 60 were seen) is asked again."""
    from echo2.errors import ConnectionError as Unreachable

    try:
        return bool(client.jobs.get(job_id).status.is_terminal())
    except Unreachable as exc:
        print(f"the API did not answer ({exc}); asking again", flush=True)
        return False


def _print_evals(client: Any, job_id: str, seen: int, start: float) -> int:
    from echo2.errors import ConnectionError as Unreachable

    try:
        evals = client.jobs.evals(job_id)
    except Unreachable:
        return seen  # printed at the next poll
    for e in evals[seen:]:
        print(f"held-out at step {e.step:4d}: greedy {_acc(e.greedy_accuracy, e.prompts)}  sampled "
              f"{_acc(e.sampled_accuracy, e.prompts)}  ({e.prompts} problems, {e.seconds:.0f} s to evaluate; "
              f"{time.monotonic() - start:.0f} s in)", flush=True)
    return len(evals)


def _acc(p: float | None, n: int) -> str:
    """An accuracy with its standard error over n problems."""
    return "-" if p is None else f"{p:.3f} ± {math.sqrt(p * (1 - p) / n):.3f}"


def _summary(client: Any, job_id: str, wall_s: float) -> None:
    job = client.jobs.get(job_id)
    metrics = client.jobs.metrics(job_id)
    rewards = [m.reward_mean or 0.0 for m in metrics]
    for b in range(0, len(rewards), 10):
        block = metrics[b:b + 10]
        print(f"steps {b + 1:3d}-{min(b + 10, len(rewards)):3d}: training reward "
              f"{statistics.mean(rewards[b:b + 10]):.3f}; {_mismatch(block)}")
    report = client.jobs.report(job_id)
    print(f"{job.status.value} at step {job.step} in {wall_s / 60:.1f} min; rollout groups "
          f"{report.rollouts.generated} generated, {report.rollouts.trained} trained, "
          f"stale {report.stale_fraction or 0:.1%}" + (f"; {job.status_reason}" if job.status_reason else ""))


def _mismatch(block: list[Any]) -> str:
    """Mean over the block's steps of the whole step's mismatch, and the KL at each staleness."""
    rows: dict[int, list[Any]] = {}
    for m in block:
        for r in m.mismatch:
            rows.setdefault(r.staleness, []).append(r)
    whole = rows.pop(-1, [])
    if not whole:
        return "mismatch -"
    kl_by = " ".join(f"s{s} {statistics.mean(r.kl for r in rs):.2e}" for s, rs in sorted(rows.items()))
    return (f"mismatch kl {statistics.mean(r.kl for r in whole):.2e} ({kl_by}), ess "
            f"{statistics.mean(r.ess for r in whole):.4f}, clipped {statistics.mean(r.clipped for r in whole):.2%}, "
            f"masked {statistics.mean(r.masked for r in whole):.2%}")


def _versions(client: Any, job_id: str) -> None:
    """Bytes of every version: the full form and the delta against the version before it."""
    versions = client.checkpoints.versions(job_id)
    full = max((v.total_size or 0 for v in versions), default=0)
    deltas = [v.delta_size for v in versions if v.delta_size is not None]
    for v in versions:
        share = f" ({v.delta_size / full:.2%} of a full version)" if v.delta_size is not None and full else ""
        print(f"version {v.version}: full {v.total_size or '-'} B, delta {v.delta_size or '-'} B{share}")
    if deltas and full:
        print(f"deltas: {len(deltas)}, median {statistics.median(deltas) / full:.2%}, max {max(deltas) / full:.2%} "
              f"of a full version ({full} B)")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--workers", type=int, default=1, help="CPU workers (transformers)")
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="published weights (auto, the default: the base model's own, bf16)")
    p.add_argument("--rounding", choices=["nearest", "dithered"], help="default: the platform's (WeightsConfig)")
    p.add_argument("--correction", default="none", choices=["none", "tis", "mis", "icepop"])
    p.add_argument("--correction-level", default="token", choices=["token", "sequence"])
    p.add_argument("--correction-high", type=float, default=2.0)
    p.add_argument("--correction-low", type=float, default=0.5)
    p.add_argument("--max-minutes", type=float, default=0, help="cancel the job after this long (0: never)")
    p.add_argument("--eval-size", type=int, default=100, help="held-out problems per evaluation")
    p.add_argument("--eval-every", type=int, default=20)
    return p.parse_args()


if __name__ == "__main__":
    run(_parse())
