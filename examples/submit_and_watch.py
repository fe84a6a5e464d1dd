"""Submit a GRPO job and watch it train: one line per learner step until the job ends.

    export ECHO2_BASE_URL=http://127.0.0.1:8000 ECHO2_API_KEY=...
    python examples/submit_and_watch.py --model echo2:tiny --task arithmetic --steps 30 --staleness 2
    python examples/submit_and_watch.py --job JOB_ID              # watch a job submitted elsewhere
    python examples/submit_and_watch.py ... --download out/       # fetch the final checkpoint at the end

Each step line shows the mean reward, the staleness of the rollouts it trained on (t - x), learner
utilisation and the job's cost so far. Ctrl-C stops watching; the job goes on (cancel it with
`echo2 jobs cancel JOB_ID`). Exit status: 0 when the job succeeded, 1 when it failed or was cancelled.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from echo2 import Client, errors
from echo2.protocol import JobRead, JobStatus, StepMetrics


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def step_line(m: StepMetrics, job: JobRead) -> str:
    stale = [t for t, n in enumerate(m.staleness_hist) for _ in range(n)]
    staleness = f"{max(stale)} (mean {sum(stale) / len(stale):.1f})" if stale else "-"
    util = "-" if m.learner_utilization is None else f"{m.learner_utilization:.0%}"
    return (f"step {m.step + 1:>4}/{job.spec.max_steps}  reward {_fmt(m.reward_mean)}  "
            f"staleness max {staleness}  groups {m.groups} ({m.groups_dropped} dropped)  "
            f"learner {util}  {m.t_train_s:.2f} s/step  cost ${job.cost.total_usd:.4f}")


def watch(client: Client, job_id: str, poll_interval: float) -> JobRead:
    """Print status changes and every new step's metrics until the job reaches a terminal state."""
    seen_step, status, job = 0, None, None
    for job in client.jobs.follow(job_id, poll_interval=poll_interval):
        if job.status != status:
            status = job.status
            reason = f" ({job.status_reason})" if job.status_reason else ""
            print(f"[{time.strftime('%H:%M:%S')}] job {job.id} is {status.value}{reason}", flush=True)
        for m in client.jobs.metrics(job_id, since_step=seen_step):
            print(step_line(m, job), flush=True)
            seen_step = m.step + 1
    assert job is not None
    return job


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Submit a GRPO job (or pick one with --job) and watch it train.")
    p.add_argument("--job", help="watch this existing job instead of submitting one")
    p.add_argument("--name", default="submit-and-watch")
    p.add_argument("--model", default="echo2:tiny", help="HF id, learner-host path or echo2:tiny / echo2:smollm2")
    p.add_argument("--task", default="arithmetic", help="task adapter (synthetic tasks need no dataset)")
    p.add_argument("--steps", type=int, default=30, help="max learner steps")
    p.add_argument("--staleness", type=int, default=2, help="S: train on rollouts at most S versions old")
    p.add_argument("--group-size", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--budget", type=float, help="stop the job when it has cost this many USD")
    p.add_argument("--poll-interval", type=float, default=2.0, help="seconds between polls")
    p.add_argument("--download", type=Path, metavar="DIR", help="download the final checkpoint here on success")
    args = p.parse_args(argv)

    try:
        with Client() as client:  # ECHO2_BASE_URL / ECHO2_API_KEY
            if args.job:
                job_id = args.job
            else:
                job = client.jobs.create(
                    name=args.name, base_model=args.model, task=args.task, staleness=args.staleness,
                    max_steps=args.steps, budget_usd=args.budget,
                    grpo={"group_size": args.group_size, "prompts_per_step": args.prompts_per_step},
                )
                job_id = job.id
                print(f"submitted job {job_id} ({job.spec.task.name} on {job.spec.base_model}, "
                      f"S={job.spec.staleness}, {job.spec.max_steps} steps)", flush=True)
            try:
                job = watch(client, job_id, args.poll_interval)
            except KeyboardInterrupt:
                print(f"\nstopped watching; job {job_id} goes on (cancel: echo2 jobs cancel {job_id})")
                return 130
            first = client.jobs.metrics(job_id, limit=1)
            start = first[0].reward_mean if first else None
            print(f"job {job.id} {job.status.value}: {job.step} steps, reward {_fmt(start)} -> "
                  f"{_fmt(job.reward_mean)}, cost ${job.cost.total_usd:.4f}")
            if job.status != JobStatus.succeeded:
                return 1
            if args.download:
                path = client.checkpoints.download(job.id, args.download)
                print(f"final checkpoint in {path}")
    except errors.Echo2Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
