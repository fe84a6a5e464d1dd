"""`echo2 jobs ...`: submit, list, get, cancel, resume, budget, watch, metrics, report, explain."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import TYPE_CHECKING, Any

from ..money import usd as dollars
from .common import PROG, Parser, UsageError, connect, key_value, print_json
from .render import describe, num, table
from .spec import spec_from_args
from .watch import mean_staleness, report_line, watch

if TYPE_CHECKING:
    from ..protocol import StepMetrics


def add_jobs(groups: Any, conn: Parser) -> Any:
    """The `jobs` group; returns its actions so other modules can add theirs."""
    jobs = groups.add_parser("jobs", help="submit, list, inspect, cancel, watch and explain training jobs")
    jc = jobs.add_subparsers(dest="command", metavar="ACTION", required=True)
    _add_submit(jc, conn)

    lst = jc.add_parser("list", parents=[conn], help="list your jobs, newest first")
    lst.add_argument("--status", choices=["queued", "running", "paused", "succeeded", "failed", "cancelled"])
    lst.add_argument("--name", help="substring of the job name")
    lst.add_argument("--limit", type=int, default=20)
    lst.add_argument("--offset", type=int, default=0)
    lst.add_argument("--json", action="store_true", help="print the page as JSON")
    lst.set_defaults(func=_list)

    for action, helptext, func in (("get", "show a job", _get), ("cancel", "cancel a job", _cancel),
                                   ("resume", "resume a job its task paused (its groups could not be scored), once "
                                              "the task is fixed", _resume)):
        p = jc.add_parser(action, parents=[conn], help=helptext)
        p.add_argument("job_id", metavar="JOB_ID")
        p.add_argument("--json", action="store_true", help="print the job as JSON")
        p.set_defaults(func=func)

    budget = jc.add_parser("budget", parents=[conn], help="change a job's budget (resumes a job it paused)")
    budget.add_argument("job_id", metavar="JOB_ID")
    budget.add_argument("usd", metavar="USD", help="the new budget in $, or `none`")
    budget.add_argument("--json", action="store_true", help="print the job as JSON")
    budget.set_defaults(func=_budget)

    w = jc.add_parser("watch", parents=[conn], help="live progress until the job finishes",
                      description="Exit status 0 if the job succeeded, 1 if it failed or was cancelled.")
    w.add_argument("job_id", metavar="JOB_ID")
    w.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="poll period")
    w.add_argument("--timeout", dest="watch_timeout", type=float, metavar="SECONDS", help="give up after")
    w.set_defaults(func=_watch)
    _add_insight(jc, conn)
    return jc


def _add_submit(jc: Any, conn: Parser) -> None:
    submit = jc.add_parser("submit", parents=[conn], help="submit a GRPO job",
                           description="Submit a job from a JSON spec file and/or flags (flags win).")
    submit.add_argument("--file", "-f", metavar="SPEC.json", help="job spec as JSON ('-' for stdin)")
    submit.add_argument("--name", help="job name (default: TASK-MODEL)")
    submit.add_argument("--model", metavar="MODEL", help="base model: HF id, learner-host path or echo2:tiny")
    submit.add_argument("--task", metavar="TASK", help="task adapter, e.g. arithmetic (echo2 tasks list)")
    submit.add_argument("--param", "-p", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                        help="task parameter (repeatable); VALUE is JSON or text")
    submit.add_argument("--dataset", metavar="DATASET_ID", help="draw prompts from an uploaded dataset")
    submit.add_argument("--steps", type=int, metavar="N", help="max learner steps")
    submit.add_argument("--staleness", type=int, metavar="S", help="staleness bound S (0 = on-policy)")
    submit.add_argument("--publish-period", type=int, metavar="K", help="publish weights every K steps")
    submit.add_argument("--group-size", type=int, metavar="G", help="samples per prompt")
    submit.add_argument("--prompts-per-step", type=int, metavar="R", help="prompt groups per step")
    submit.add_argument("--lr", type=float, help="learning rate")
    submit.add_argument("--max-new-tokens", type=int, metavar="N", help="completion length cap")
    submit.add_argument("--num-prompts", type=int, metavar="N", help="prompts to generate (synthetic tasks)")
    submit.add_argument("--budget", type=float, metavar="USD", help="pause the job when this much is spent")
    submit.add_argument("--seed", type=int)
    submit.add_argument("--priority", type=int, help="higher first; above 0 is an admin's to give")
    submit.add_argument("--set", action="append", type=key_value, default=[], dest="sets",
                        metavar="PATH=VALUE", help="any spec field by dotted path, e.g. grpo.kl_coef=0.01")
    submit.add_argument("--idempotency-key", metavar="KEY",
                        help="resubmitting with the same key returns the same job")
    submit.add_argument("--watch", action="store_true", help="follow the job until it finishes")
    submit.add_argument("--json", action="store_true", help="print the job as JSON")
    submit.set_defaults(func=_submit)


def _add_insight(jc: Any, conn: Parser) -> None:
    """metrics, report, explain: what a job did and why."""
    metrics = jc.add_parser("metrics", parents=[conn], help="per-step training metrics")
    metrics.add_argument("job_id", metavar="JOB_ID")
    metrics.add_argument("--since", type=int, default=0, metavar="STEP",
                         help="the first step shown (default 0); every step from it on is shown")
    metrics.add_argument("--json", action="store_true")
    metrics.set_defaults(func=_metrics)

    report = jc.add_parser("report", parents=[conn], help="learner utilisation and wasted rollouts of a job",
                           description="The learner's busy and idle time, and every group generated by what "
                                       "became of it (trained, waiting, rejected by reason).")
    report.add_argument("job_id", metavar="JOB_ID")
    report.add_argument("--json", action="store_true")
    report.set_defaults(func=_report)

    explain = jc.add_parser("explain", parents=[conn], help="why the scheduler activated or released workers",
                            description="Why each worker is where it is (its newest activation, release or skip "
                                        "reason) first; then the scheduler's decisions for the job, newest first, "
                                        "one line each with its time, action and explanation (a worker's "
                                        "repeated 'kept' lines folded into one with their count); then the "
                                        "failed audits of its rollouts, each with the worker's trust state.")
    explain.add_argument("job_id", metavar="JOB_ID")
    explain.add_argument("--limit", type=int, default=50, metavar="N", help="decisions shown (default 50, max 200)")
    explain.add_argument("--json", action="store_true", help="print the decisions as JSON (with their triggers)")
    explain.set_defaults(func=_explain)


def _submit(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    with connect(args) as client:
        job = client.jobs.create(spec, idempotency_key=args.idempotency_key)
        if args.json:
            print_json(job)
        else:
            print(f"submitted job {job.id} ({job.spec.name}): {job.status.value}, {job.num_prompts} prompts")
            if not args.watch:
                print(f"follow it with: {PROG} jobs watch {job.id}")
        if args.watch:
            # With --json, stdout is the job's JSON alone, for a script to parse: what the watch says goes to stderr.
            with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
                return watch(client, job.id, 2.0, None)
    return 0


def _list(args: argparse.Namespace) -> int:
    with connect(args) as client:
        page = client.jobs.list(status=args.status, name=args.name, limit=args.limit, offset=args.offset)
    if args.json:
        print_json(page)
        return 0
    rows = [[j.id, j.spec.name, j.status.value, f"{j.step}/{j.spec.max_steps}", num(j.reward_mean),
             f"${j.cost.total_usd:.4f}", j.created_at.strftime("%Y-%m-%d %H:%M")] for j in page.items]
    table(["ID", "NAME", "STATUS", "STEP", "REWARD", "COST", "CREATED"], rows)
    shown = args.offset + len(page.items)
    if page.next_offset is not None:
        print(f"({shown} of {page.total}; more with --offset {page.next_offset})")
    return 0


def _get(args: argparse.Namespace) -> int:
    with connect(args) as client:
        job = client.jobs.get(args.job_id)
    if args.json:
        print_json(job)
    else:
        describe(job)
    return 0


def _cancel(args: argparse.Namespace) -> int:
    with connect(args) as client:
        job = client.jobs.cancel(args.job_id)
    if args.json:
        print_json(job)
    else:
        print(f"job {job.id} {job.status.value}" + (f": {job.status_reason}" if job.status_reason else ""))
    return 0


def _resume(args: argparse.Namespace) -> int:
    with connect(args) as client:
        job = client.jobs.resume(args.job_id)
    if args.json:
        print_json(job)
    else:
        print(f"job {job.id} {job.status.value}: its learner resumes from step {job.step}")
    return 0


def _budget(args: argparse.Namespace) -> int:
    usd = None if args.usd.lower() == "none" else _usd(args.usd)
    with connect(args) as client:
        job = client.jobs.update(args.job_id, budget_usd=usd)
    if args.json:
        print_json(job)
    else:
        print(f"job {job.id} {job.status.value}, budget {'none' if usd is None else dollars(usd)}"
              + (f": {job.status_reason}" if job.status_reason else ""))
    return 0


def _usd(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"budget: expected an amount in $ or `none`, got {text!r}") from None


def _watch(args: argparse.Namespace) -> int:
    with connect(args) as client:
        return watch(client, args.job_id, args.interval, args.watch_timeout)


def _metrics(args: argparse.Namespace) -> int:
    with connect(args) as client:
        rows = client.jobs.metrics(args.job_id, since_step=args.since)
    if args.json:
        print(json.dumps([m.model_dump(mode="json") for m in rows], indent=2))
        return 0
    table(["STEP", "REWARD", "LOSS", "KL", "CLIP", "STALENESS", "MISMATCH_KL", "ESS", "T_TRAIN", "UTIL", "COST"],
          [[m.step, num(m.reward_mean), num(m.loss), num(m.kl), num(m.clip_frac),
            num(mean_staleness(m), 2), *_mismatch_cells(m), num(m.t_train_s, 2), num(m.learner_utilization, 2),
            "-" if m.cost_usd is None else f"${m.cost_usd:.4f}"] for m in rows])
    return 0


def _mismatch_cells(m: StepMetrics) -> list[str]:
    whole = next((r for r in m.mismatch if r.staleness < 0), None)
    return ["-", "-"] if whole is None else [f"{whole.kl:.2g}", f"{whole.ess:.3f}"]


def _report(args: argparse.Namespace) -> int:
    with connect(args) as client:
        report = client.jobs.report(args.job_id)
    if args.json:
        print_json(report)
    else:
        print(report_line(report))
    return 0


def _explain(args: argparse.Namespace) -> int:
    with connect(args) as client:
        decisions = client.jobs.decisions(args.job_id, limit=args.limit)
        failed = client.jobs.audits(args.job_id, passed=False, limit=args.limit)
    if args.json:
        print(json.dumps({"decisions": [d.model_dump(mode="json") for d in decisions],
                          "failed_audits": [a.model_dump(mode="json") for a in failed]}, indent=2))
        return 0
    for line in explain_lines(decisions):
        print(line)
    if not decisions:
        print("(no activation decisions yet)")
    for a in failed:
        state = a.worker_trust.value if a.worker_trust else "unknown"
        print(f"{a.created_at.strftime('%Y-%m-%d %H:%M:%S')}  audit fail   {a.worker_id} ({state}): "
              f"rollout {a.rollout_id} of version {a.version}: {a.reason}")
    return 0


def explain_lines(decisions: list[Any]) -> list[str]:
    """Why each worker is where it is (its newest line that is not a "kept") first; then the history, newest
    first, where each worker's run of "kept" decisions between two changes is one line with its count (the
    server stores a run as one line with `repeats`; older rows of one each are folded here): a job re-solved
    every tick would otherwise bury its activation reasons under pages of "still chosen"."""
    if not decisions:
        return []
    latest: dict[str, Any] = {}
    for d in decisions:
        if d.action != "kept":
            latest.setdefault(d.worker_id, d)
    history: list[tuple[Any, int, Any]] = []  # (newest decision, how many, oldest time)
    folding: dict[str, int] = {}  # worker -> where its run of "kept" lines is in `history`
    for d in decisions:
        at = folding.get(d.worker_id)
        if d.action == "kept" and at is not None:
            history[at] = (history[at][0], history[at][1] + d.repeats, d.created_at)
            continue
        if d.action == "kept":
            folding[d.worker_id] = len(history)
        else:
            folding.pop(d.worker_id, None)
        history.append((d, d.repeats, d.created_at))
    folded = [_row(d) + (f"  (x{n} since {since:%H:%M:%S})" if n > 1 else "") for d, n, since in history]
    return (["why each worker is where it is (its newest reason):"] + [f"  {_row(d)}" for d in latest.values()]
            + ['history, newest first (a worker\'s repeated "kept" lines folded):'] + [f"  {r}" for r in folded])


def _row(d: Any) -> str:
    return f"{d.decided_at or d.created_at:%Y-%m-%d %H:%M:%S}  {d.action:<11}  {' '.join(d.line.split())}"
