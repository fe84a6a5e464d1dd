"""Following a job: the live progress line, and the report printed when it ends (or on `jobs report`)."""

from __future__ import annotations

import shutil
import sys
from typing import TYPE_CHECKING

from .common import PROG
from .render import num

if TYPE_CHECKING:
    from ..client import Client
    from ..protocol import EvalRead, JobRead, JobReport, MismatchStats, RolloutCounts, StepMetrics


def watch(client: Client, job_id: str, interval: float, timeout: float | None) -> int:
    """Redraw one progress line (or print a line per change of step, version, status or figures when not a
    terminal) until the job ends."""
    tty = sys.stdout.isatty()
    latest: StepMetrics | None = None
    held_out: list[EvalRead] = []
    shown = ""
    said = ""  # the last pause reason printed
    job: JobRead | None = None
    try:
        for job in client.jobs.follow(job_id, poll_interval=interval, timeout=timeout):
            said = _say_pause(job, said, tty)
            if latest is None or job.step > latest.step + 1:
                fresh = client.jobs.metrics(job_id, since_step=0 if latest is None else latest.step + 1)
                latest = fresh[-1] if fresh else latest
                held_out = client.jobs.evals(job_id)
            line = _progress(job, latest, held_out[-1] if held_out else None)
            if tty:
                width = shutil.get_terminal_size().columns - 1
                sys.stdout.write("\r\033[K" + line[:width])
                sys.stdout.flush()
            elif _without_cost(line) != _without_cost(shown):  # the cost moves at every poll: not a change
                print(line, flush=True)
            shown = line
    except KeyboardInterrupt:
        if tty:
            sys.stdout.write("\n")
        print(f"{PROG}: stopped watching; job {job_id} keeps running", file=sys.stderr)
        return 130
    if tty:
        sys.stdout.write("\n")
    assert job is not None
    return _finish(client, job_id, job)


def _say_pause(job: JobRead, said: str, tty: bool) -> str:
    """A paused job's reason, on a line of its own once (the watch goes on: the job may be resumed)."""
    reason = f"job {job.id} paused: {job.status_reason}" if job.status.value == "paused" and job.status_reason else ""
    if reason and reason != said:
        print(("\r\033[K" if tty else "") + reason, flush=True)
    return reason


def _finish(client: Client, job_id: str, job: JobRead) -> int:
    """The job's outcome and report; exit status 0 only if it succeeded."""
    reason = f" ({job.status_reason})" if job.status_reason else ""
    print(f"job {job.id} {job.status.value}{reason}: {job.step}/{job.spec.max_steps} steps done, "
          f"reward {num(job.reward_mean)}, cost ${job.cost.total_usd:.4f}")
    print(report_line(client.jobs.report(job_id)))
    return 0 if job.status.value == "succeeded" else 1


def report_line(r: JobReport) -> str:
    util = "-" if r.learner_utilization is None else f"{r.learner_utilization:.0%}"
    rejected = ", ".join(f"{k.value} {n}" for k, n in sorted(r.rollouts.rejected.items())) or "none"
    stale = "-" if r.stale_fraction is None else f"{r.stale_fraction:.1%}"
    lines = [f"learner busy {r.learner_busy_s:.0f}s of {r.learner_wall_s:.0f}s ({util}); groups: "
             f"{r.rollouts.generated} generated, {r.rollouts.trained} trained, {_left(r.rollouts)}; "
             f"rejected: {rejected}; stale {stale}", _held_out_line(r)]
    if any(m.staleness < 0 for m in r.mismatch):  # none before a step trained tokens
        lines.insert(1, f"{mismatch_text(r.mismatch)} (all steps)")
    return "\n".join(lines)


def _left(counts: RolloutCounts) -> str:
    """The groups not trained yet, or, once the job ended, never."""
    return f"{counts.unused} never trained (the job ended first)" if counts.unused else f"{counts.waiting} waiting"


def _held_out_line(r: JobReport) -> str:
    """Held-out accuracy before -> after: what the job learned on problems it never trained on."""
    before, after = r.eval_before, r.eval_after
    if before is None and after is None:  # none reported yet, or the job holds no prompt out
        return ("held-out accuracy: none reported yet (the learner evaluates the base model first; a job that holds "
                "no prompts out reports none)")
    latest = after or before
    assert latest is not None
    step = f" at step {latest.step}" if after is not None else ""
    return (f"held-out accuracy ({latest.prompts} prompts never trained on): greedy "
            f"{num(before.greedy_accuracy if before else None)} -> {num(latest.greedy_accuracy)}, sampled "
            f"{num(before.sampled_accuracy if before else None)} -> {num(latest.sampled_accuracy)}{step}")


def _progress(job: JobRead, m: StepMetrics | None, held_out: EvalRead | None = None) -> str:
    stale = mean_staleness(m) if m is not None else None
    parts = [
        # Steps done, not a step's number: `jobs metrics` numbers steps from 0, and the reward is the last one's.
        job.id, f"{job.status.value:<9}", f"{job.step}/{job.spec.max_steps} steps done",
        f"v{job.version}" if job.version is not None else "v-",
        f"reward {num(job.reward_mean)}",
        f"held-out {num(held_out.greedy_accuracy)} (step {held_out.step})" if held_out else "held-out -",
        f"staleness {num(stale, 2)} (S={job.spec.staleness})",
        mismatch_text(m.mismatch if m is not None else []),
        f"cost ${job.cost.total_usd:.4f}",
    ]
    return "  ".join(parts)


def mismatch_text(rows: list[MismatchStats]) -> str:
    """The mismatch of all the step's tokens (staleness -1), and the KL of each staleness beside it."""
    whole = next((r for r in rows if r.staleness < 0), None)
    if whole is None:
        return "mismatch -"
    by = " ".join(f"s{r.staleness} {r.kl:.2g}" for r in rows if r.staleness >= 0)
    return (f"mismatch kl {whole.kl:.2g} ({by}) ess {whole.ess:.2f} clipped {whole.clipped:.1%} "
            f"masked {whole.masked:.1%}")


def _without_cost(line: str) -> str:
    return line.rsplit("  cost $", 1)[0]


def mean_staleness(m: StepMetrics) -> float | None:
    total = sum(m.staleness_hist)
    return sum(i * n for i, n in enumerate(m.staleness_hist)) / total if total else None
