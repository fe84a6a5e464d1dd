"""The `echo2` command: submit, list, inspect, cancel and watch jobs; upload datasets; download checkpoints.

Only the standard library is imported until a command runs, so `echo2 --help` answers at once.
Errors are one line on stderr (no traceback) and a non-zero exit status: 2 for a bad command line,
1 for anything the server or the local system refused, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from .client import Client
    from .protocol import EvalRead, JobRead, JobReport, StepMetrics

PROG = "echo2"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage itself is one `--help` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _UsageError(Exception):
    """A command line that parses but does not make sense (exit status 2)."""


# --------------------------------------------------------------------------------------------------
# Parser


def _connection_options(top: bool) -> _Parser:
    """--base-url/--api-key/--request-timeout, accepted before or after the subcommand."""
    parent = _Parser(add_help=False)
    # Below the top level the default is SUPPRESS, so an option given before the subcommand survives.
    default: Any = None if top else argparse.SUPPRESS
    group = parent.add_argument_group("connection")
    group.add_argument("--base-url", default=default, metavar="URL",
                       help="Echo2 server URL (default: $ECHO2_BASE_URL)")
    group.add_argument("--api-key", default=default, metavar="KEY", help="API key (default: $ECHO2_API_KEY)")
    group.add_argument("--request-timeout", type=float, default=default, metavar="SECONDS",
                       help="per-request timeout (default: 60)")
    return parent


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), _value(raw)


def _value(raw: str) -> Any:
    """`3` -> 3, `0.5` -> 0.5, `true` -> True, `null` -> None, `[1,2]` -> list; anything else stays text."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def build_parser() -> argparse.ArgumentParser:
    conn = _connection_options(top=False)
    parser = _Parser(prog=PROG, parents=[_connection_options(top=True)],
                     description="Echo2: RL post-training jobs on a central learner with distributed rollout "
                                 "workers. Configure with ECHO2_BASE_URL and ECHO2_API_KEY.")
    groups = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)

    jobs = groups.add_parser("jobs", help="submit, list, inspect, cancel, watch and explain training jobs")
    jc = jobs.add_subparsers(dest="command", metavar="ACTION", required=True)

    submit = jc.add_parser("submit", parents=[conn], help="submit a GRPO job",
                           description="Submit a job from a JSON spec file and/or flags (flags win).")
    submit.add_argument("--file", "-f", metavar="SPEC.json", help="job spec as JSON ('-' for stdin)")
    submit.add_argument("--name", help="job name (default: TASK-MODEL)")
    submit.add_argument("--model", metavar="MODEL", help="base model: HF id, learner-host path or echo2:tiny")
    submit.add_argument("--task", metavar="TASK", help="task adapter, e.g. arithmetic (echo2 tasks list)")
    submit.add_argument("--param", "-p", action="append", type=_key_value, default=[], metavar="KEY=VALUE",
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
    submit.add_argument("--priority", type=int)
    submit.add_argument("--set", action="append", type=_key_value, default=[], dest="sets",
                        metavar="PATH=VALUE", help="any spec field by dotted path, e.g. grpo.kl_coef=0.01")
    submit.add_argument("--idempotency-key", metavar="KEY",
                        help="resubmitting with the same key returns the same job")
    submit.add_argument("--watch", action="store_true", help="follow the job until it finishes")
    submit.add_argument("--json", action="store_true", help="print the job as JSON")
    submit.set_defaults(func=_jobs_submit)

    lst = jc.add_parser("list", parents=[conn], help="list your jobs, newest first")
    lst.add_argument("--status", choices=["queued", "running", "paused", "succeeded", "failed", "cancelled"])
    lst.add_argument("--name", help="substring of the job name")
    lst.add_argument("--limit", type=int, default=20)
    lst.add_argument("--offset", type=int, default=0)
    lst.add_argument("--json", action="store_true", help="print the page as JSON")
    lst.set_defaults(func=_jobs_list)

    for action, helptext, func in (("get", "show a job", _jobs_get),
                                   ("cancel", "cancel a job", _jobs_cancel)):
        p = jc.add_parser(action, parents=[conn], help=helptext)
        p.add_argument("job_id", metavar="JOB_ID")
        p.add_argument("--json", action="store_true", help="print the job as JSON")
        p.set_defaults(func=func)

    budget = jc.add_parser("budget", parents=[conn], help="change a job's budget (resumes a job it paused)")
    budget.add_argument("job_id", metavar="JOB_ID")
    budget.add_argument("usd", metavar="USD", help="the new budget in $, or `none`")
    budget.add_argument("--json", action="store_true", help="print the job as JSON")
    budget.set_defaults(func=_jobs_budget)

    watch = jc.add_parser("watch", parents=[conn], help="live progress until the job finishes",
                          description="Exit status 0 if the job succeeded, 1 if it failed or was cancelled.")
    watch.add_argument("job_id", metavar="JOB_ID")
    watch.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="poll period")
    watch.add_argument("--timeout", dest="watch_timeout", type=float, metavar="SECONDS", help="give up after")
    watch.set_defaults(func=_jobs_watch)

    metrics = jc.add_parser("metrics", parents=[conn], help="per-step training metrics")
    metrics.add_argument("job_id", metavar="JOB_ID")
    metrics.add_argument("--since", type=int, default=0, metavar="STEP")
    metrics.add_argument("--json", action="store_true")
    metrics.set_defaults(func=_jobs_metrics)

    report = jc.add_parser("report", parents=[conn], help="learner utilisation and wasted rollouts of a job",
                           description="The learner's busy and idle time, and every group generated by what "
                                       "became of it (trained, waiting, rejected by reason).")
    report.add_argument("job_id", metavar="JOB_ID")
    report.add_argument("--json", action="store_true")
    report.set_defaults(func=_jobs_report)

    explain = jc.add_parser("explain", parents=[conn], help="why the scheduler activated or released workers",
                            description="The scheduler's activation decisions for a job, newest first: "
                                        "one line each with its time, action and explanation; then the "
                                        "failed audits of its rollouts, each with the worker's trust state.")
    explain.add_argument("job_id", metavar="JOB_ID")
    explain.add_argument("--limit", type=int, default=50, metavar="N", help="decisions shown (default 50, max 200)")
    explain.add_argument("--json", action="store_true", help="print the decisions as JSON (with their triggers)")
    explain.set_defaults(func=_jobs_explain)

    datasets = groups.add_parser("datasets", help="upload and list prompt datasets")
    dc = datasets.add_subparsers(dest="command", metavar="ACTION", required=True)
    upload = dc.add_parser("upload", parents=[conn], help="upload a JSONL file (one JSON object per line)")
    upload.add_argument("name", metavar="NAME")
    upload.add_argument("file", metavar="FILE.jsonl")
    upload.add_argument("--json", action="store_true")
    upload.set_defaults(func=_datasets_upload)
    dlist = dc.add_parser("list", parents=[conn], help="list your datasets")
    dlist.add_argument("--json", action="store_true")
    dlist.set_defaults(func=_datasets_list)

    tasks = groups.add_parser("tasks", help="registered task adapters")
    tc = tasks.add_subparsers(dest="command", metavar="ACTION", required=True)
    tlist = tc.add_parser("list", parents=[conn], help="list task adapters and their parameters")
    tlist.add_argument("--json", action="store_true")
    tlist.set_defaults(func=_tasks_list)

    ckpt = groups.add_parser("checkpoints", help="download trained checkpoints")
    cc = ckpt.add_subparsers(dest="command", metavar="ACTION", required=True)
    down = cc.add_parser("download", parents=[conn], help="download a job's checkpoint as an HF model folder")
    down.add_argument("job_id", metavar="JOB_ID")
    down.add_argument("dest", metavar="DIR")
    down.add_argument("--version", type=int,
                      help="weight version (default: the final checkpoint, else the latest)")
    down.add_argument("--overwrite", action="store_true", help="replace DIR if it is not empty")
    down.set_defaults(func=_checkpoints_download)
    _money_commands(groups, jc, conn)
    return parser


# --------------------------------------------------------------------------------------------------
# Commands


def _client(args: argparse.Namespace) -> Client:
    from .client import Client

    return Client(base_url=args.base_url, api_key=args.api_key, timeout=args.request_timeout)


def _print_json(model: Any) -> None:
    print(model.model_dump_json(indent=2))


def _jobs_submit(args: argparse.Namespace) -> int:
    spec = _spec_from_args(args)
    with _client(args) as client:
        job = client.jobs.create(spec, idempotency_key=args.idempotency_key)
        if args.json:
            _print_json(job)
        else:
            print(f"submitted job {job.id} ({job.spec.name}): {job.status.value}, {job.num_prompts} prompts")
            if not args.watch:
                print(f"follow it with: {PROG} jobs watch {job.id}")
        if args.watch:
            return _watch(client, job.id, 2.0, None)
    return 0


_FLAG_PATHS = {
    "dataset": "dataset_id", "steps": "max_steps", "staleness": "staleness",
    "publish_period": "publish_period", "num_prompts": "num_prompts", "budget": "budget_usd",
    "seed": "seed", "priority": "priority",
    "group_size": "grpo.group_size", "prompts_per_step": "grpo.prompts_per_step", "lr": "grpo.lr",
    "max_new_tokens": "grpo.max_new_tokens",
}


def _spec_from_args(args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = _read_spec(args.file) if args.file else {}
    if args.model:
        spec["base_model"] = args.model
    task = spec.get("task")
    if isinstance(task, str):
        task = {"name": task}
    if args.task:
        task = {"name": args.task} if not isinstance(task, dict) or task.get("name") != args.task else task
    if args.param:
        if not isinstance(task, dict):
            raise _UsageError("--param needs a task: give --task or a spec file with one")
        task = {**task, "params": {**(task.get("params") or {}), **dict(args.param)}}
    if task is not None:
        spec["task"] = task
    if not spec.get("base_model") or not spec.get("task"):
        raise _UsageError("give --file SPEC.json, or --model and --task")
    if args.name:
        spec["name"] = args.name
    elif "name" not in spec:
        model_tail = str(spec["base_model"]).rstrip("/").split("/")[-1].replace(":", "-")
        spec["name"] = f"{spec['task'].get('name', 'job')}-{model_tail}"[:128]
    for flag, path in _FLAG_PATHS.items():
        value = getattr(args, flag)
        if value is not None:
            _set_path(spec, path, value)
    for path, value in args.sets:
        _set_path(spec, path, value)
    return spec


def _read_spec(path: str) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()  # noqa: SIM115
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object (the job spec)")
    return data


def _set_path(spec: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = spec
    for part in parents:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise _UsageError(f"cannot set {path}: {part} is not an object")
        node = child
    node[leaf] = value


def _jobs_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        page = client.jobs.list(status=args.status, name=args.name, limit=args.limit, offset=args.offset)
    if args.json:
        _print_json(page)
        return 0
    rows = [[j.id, j.spec.name, j.status.value, f"{j.step}/{j.spec.max_steps}", _num(j.reward_mean),
             f"${j.cost.total_usd:.4f}", j.created_at.strftime("%Y-%m-%d %H:%M")] for j in page.items]
    _table(["ID", "NAME", "STATUS", "STEP", "REWARD", "COST", "CREATED"], rows)
    shown = args.offset + len(page.items)
    if page.next_offset is not None:
        print(f"({shown} of {page.total}; more with --offset {page.next_offset})")
    return 0


def _jobs_get(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.jobs.get(args.job_id)
    if args.json:
        _print_json(job)
    else:
        _describe(job)
    return 0


def _jobs_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.jobs.cancel(args.job_id)
    if args.json:
        _print_json(job)
    else:
        print(f"job {job.id} {job.status.value}" + (f": {job.status_reason}" if job.status_reason else ""))
    return 0


def _jobs_budget(args: argparse.Namespace) -> int:
    usd = None if args.usd.lower() == "none" else _usd(args.usd)
    with _client(args) as client:
        job = client.jobs.update(args.job_id, budget_usd=usd)
    if args.json:
        _print_json(job)
    else:
        print(f"job {job.id} {job.status.value}, budget {'none' if usd is None else f'${usd:.2f}'}"
              + (f": {job.status_reason}" if job.status_reason else ""))
    return 0


def _usd(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise _UsageError(f"budget: expected an amount in $ or `none`, got {text!r}") from None


def _jobs_watch(args: argparse.Namespace) -> int:
    with _client(args) as client:
        return _watch(client, args.job_id, args.interval, args.watch_timeout)


def _jobs_metrics(args: argparse.Namespace) -> int:
    with _client(args) as client:
        rows = client.jobs.metrics(args.job_id, since_step=args.since)
    if args.json:
        print(json.dumps([m.model_dump(mode="json") for m in rows], indent=2))
        return 0
    _table(["STEP", "REWARD", "LOSS", "KL", "CLIP", "STALENESS", "T_TRAIN", "UTIL", "COST"],
           [[m.step, _num(m.reward_mean), _num(m.loss), _num(m.kl), _num(m.clip_frac),
             _num(_mean_staleness(m), 2), _num(m.t_train_s, 2), _num(m.learner_utilization, 2),
             "-" if m.cost_usd is None else f"${m.cost_usd:.4f}"] for m in rows])
    return 0


def _jobs_explain(args: argparse.Namespace) -> int:
    with _client(args) as client:
        decisions = client.jobs.decisions(args.job_id, limit=args.limit)
        failed = client.jobs.audits(args.job_id, passed=False, limit=args.limit)
    if args.json:
        print(json.dumps({"decisions": [d.model_dump(mode="json") for d in decisions],
                          "failed_audits": [a.model_dump(mode="json") for a in failed]}, indent=2))
        return 0
    for d in decisions:
        print(f"{d.created_at.strftime('%Y-%m-%d %H:%M:%S')}  {d.action:<11}  {' '.join(d.line.split())}")
    if not decisions:
        print("(no activation decisions yet)")
    for a in failed:
        state = a.worker_trust.value if a.worker_trust else "unknown"
        print(f"{a.created_at.strftime('%Y-%m-%d %H:%M:%S')}  audit fail   {a.worker_id} ({state}): "
              f"rollout {a.rollout_id} of version {a.version}: {a.reason}")
    return 0


def _datasets_upload(args: argparse.Namespace) -> int:
    with _client(args) as client:
        dataset = client.datasets.upload(args.name, args.file)
    if args.json:
        _print_json(dataset)
    else:
        print(f"uploaded dataset {dataset.id} ({dataset.name}): {dataset.num_items} items, "
              f"keys {', '.join(dataset.keys) or '-'}")
    return 0


def _datasets_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        page = client.datasets.list()
    if args.json:
        _print_json(page)
    else:
        _table(["ID", "NAME", "ITEMS", "KEYS", "CREATED"],
               [[d.id, d.name, d.num_items, ",".join(d.keys), d.created_at.strftime("%Y-%m-%d %H:%M")]
                for d in page.items])
    return 0


def _tasks_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        tasks = client.tasks.list()
    if args.json:
        print(json.dumps([t.model_dump(mode="json") for t in tasks], indent=2))
    else:
        _table(["TASK", "DATASET", "PARAMETERS", "DESCRIPTION"],
               [[t.name, "needed" if t.needs_dataset else "-",
                 ",".join(t.params_schema.get("properties", {})) or "-", t.description] for t in tasks])
    return 0


def _checkpoints_download(args: argparse.Namespace) -> int:
    with _client(args) as client:
        path = client.checkpoints.download(args.job_id, args.dest, version=args.version,
                                           overwrite=args.overwrite)
    files = sorted(p for p in path.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files)
    print(f"downloaded {len(files)} files ({size / 2**20:.1f} MiB) to {path}")
    return 0


# --------------------------------------------------------------------------------------------------
# Money: `jobs estimate`, `jobs ledger`, `providers statement`


def _money_commands(groups: Any, jobs: Any, conn: _Parser) -> None:
    estimate = jobs.add_parser("estimate", parents=[conn], help="estimate a job's cost before submitting it",
                               description="What a job spec would cost; nothing is created. Learner time comes "
                                           "from earlier jobs like it, workers from the set the capacity rule "
                                           "would activate now; the assumptions are printed with the figures.")
    estimate.add_argument("--spec", "--file", "-f", dest="file", required=True, metavar="SPEC.json",
                          help="job spec as JSON ('-' for stdin), as `jobs submit --file` reads it")
    estimate.add_argument("--set", action="append", type=_key_value, default=[], dest="sets",
                          metavar="PATH=VALUE", help="any spec field by dotted path, e.g. max_steps=50")
    estimate.add_argument("--json", action="store_true", help="print the estimate as JSON")
    estimate.set_defaults(func=_jobs_estimate)

    ledger = jobs.add_parser("ledger", parents=[conn], help="what a job cost, entry by entry",
                             description="The job's ledger entries, oldest first, each saying what it paid for; "
                                         "then the totals by kind, which sum to the job's cost.")
    ledger.add_argument("job_id", metavar="JOB_ID")
    ledger.add_argument("--limit", type=int, default=1000, metavar="N", help="entries shown (max 10000)")
    ledger.add_argument("--offset", type=int, default=0, metavar="N")
    ledger.add_argument("--json", action="store_true", help="print the ledger as JSON")
    ledger.set_defaults(func=_jobs_ledger)

    providers = groups.add_parser("providers", help="a GPU provider's earnings")
    pc = providers.add_subparsers(dest="command", metavar="ACTION", required=True)
    statement = pc.add_parser("statement", parents=[conn], help="ledger entries and totals per worker and job",
                              description="Your statement with a provider token as the API key; any "
                                          "provider's with --provider and an admin key.")
    statement.add_argument("--provider", metavar="PROVIDER_ID", help="whose statement (admin)")
    statement.add_argument("--since", metavar="TIME", help="entries from this time (ISO 8601; UTC without offset)")
    statement.add_argument("--until", metavar="TIME", help="entries before this time")
    statement.add_argument("--limit", type=int, default=1000, metavar="N", help="entries shown (max 10000)")
    statement.add_argument("--offset", type=int, default=0, metavar="N")
    form = statement.add_mutually_exclusive_group()
    form.add_argument("--csv", action="store_true", help="print the entries as CSV with a header row")
    form.add_argument("--json", action="store_true", help="print the statement as JSON")
    statement.set_defaults(func=_providers_statement)


def _jobs_estimate(args: argparse.Namespace) -> int:
    spec = _read_spec(args.file)
    for path, value in args.sets:
        _set_path(spec, path, value)
    with _client(args) as client:
        e = client.jobs.estimate(spec)
    if args.json:
        _print_json(e)
        return 0
    print(f"estimate ${e.cost_usd:.4f}: learner ${e.learner_usd:.4f} (${e.learner_price_per_hour:.2f}/h), workers "
          f"${e.workers_usd:.4f} (${e.workers_price_per_hour:.2f}/h) over {e.wall_s:.0f} s, {e.step_s:.2f} s a step")
    _table(["WORKER", "NAME", "PRICE", "GROUPS/S", "FRESH", "RATE FROM"],
           [[w.worker_id, w.name, f"${w.price_per_hour:.2f}/h", _num(w.mu), "yes" if w.fresh else "no",
             w.mu_source] for w in e.workers])
    for line in e.assumptions:
        print(f"- {line}")
    return 0


def _jobs_ledger(args: argparse.Namespace) -> int:
    with _client(args) as client:
        ledger = client.jobs.ledger(args.job_id, limit=args.limit, offset=args.offset)
    if args.json:
        _print_json(ledger)
        return 0
    _table(["TIME", "KIND", "WORKER", "STEP", "SECONDS", "AMOUNT", "MEMO"],
           [[_when(e.created_at), e.kind.value, e.worker_id or "-", "-" if e.step is None else e.step,
             f"{e.seconds:.1f}", f"${e.amount_usd:.6f}", e.memo or ""] for e in ledger.entries])
    _more(args.offset, len(ledger.entries), ledger.total_entries, ledger.next_offset)
    kinds = ", ".join(f"{t.key} ${t.amount_usd:.4f}" for t in ledger.by_kind) or "nothing yet"
    print(f"total ${ledger.total_usd:.4f} ({kinds}); the job's cost ${ledger.cost.total_usd:.4f}")
    return 0


def _providers_statement(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.csv:
            sys.stdout.write(client.providers.statement_csv(args.provider, since=args.since, until=args.until,
                                                            limit=args.limit, offset=args.offset))
            return 0
        st = client.providers.statement(args.provider, since=args.since, until=args.until, limit=args.limit,
                                        offset=args.offset)
    if args.json:
        _print_json(st)
        return 0
    _table(["TIME", "WORKER", "JOB", "STEP", "GROUPS", "SECONDS", "AMOUNT", "MEMO"],
           [[_when(e.created_at), e.worker_id or "-", e.job_id, "-" if e.step is None else e.step, e.groups,
             f"{e.seconds:.1f}", f"${e.amount_usd:.6f}", e.memo or ""] for e in st.entries])
    _more(args.offset, len(st.entries), st.total_entries, st.next_offset)
    for title, totals in (("WORKER", st.by_worker), ("JOB", st.by_job)):
        print()
        _table([title, "ENTRIES", "GROUPS", "SECONDS", "AMOUNT"],
               [[t.key, t.entries, t.groups, f"{t.seconds:.1f}", f"${t.amount_usd:.4f}"] for t in totals])
    print(f"\ntotal ${st.total_usd:.4f} in the period; earnings ${st.earnings_usd:.4f} since sign-up")
    return 0


def _when(t: Any) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S")


def _more(offset: int, shown: int, total: int, next_offset: int | None) -> None:
    if next_offset is not None:
        print(f"({offset + shown} of {total} entries; more with --offset {next_offset})")


# --------------------------------------------------------------------------------------------------
# Output


def _watch(client: Client, job_id: str, interval: float, timeout: float | None) -> int:
    """Redraw one progress line (or print a line per change when not a terminal) until the job ends."""
    tty = sys.stdout.isatty()
    latest: StepMetrics | None = None
    held_out: list[EvalRead] = []
    shown = ""
    job: JobRead | None = None
    try:
        for job in client.jobs.follow(job_id, poll_interval=interval, timeout=timeout):
            if latest is None or job.step > latest.step + 1:
                fresh = client.jobs.metrics(job_id, since_step=0 if latest is None else latest.step + 1)
                latest = fresh[-1] if fresh else latest
                held_out = client.jobs.evals(job_id)
            line = _progress(job, latest, held_out[-1] if held_out else None)
            if tty:
                width = shutil.get_terminal_size().columns - 1
                sys.stdout.write("\r\033[K" + line[:width])
                sys.stdout.flush()
            elif line != shown:
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
    reason = f" ({job.status_reason})" if job.status_reason else ""
    print(f"job {job.id} {job.status.value}{reason}: step {job.step}/{job.spec.max_steps}, "
          f"reward {_num(job.reward_mean)}, cost ${job.cost.total_usd:.4f}")
    print(_report_line(client.jobs.report(job_id)))
    return 0 if job.status.value == "succeeded" else 1


def _report_line(r: JobReport) -> str:
    util = "-" if r.learner_utilization is None else f"{r.learner_utilization:.0%}"
    rejected = ", ".join(f"{k.value} {n}" for k, n in sorted(r.rollouts.rejected.items())) or "none"
    stale = "-" if r.stale_fraction is None else f"{r.stale_fraction:.1%}"
    return (f"learner busy {r.learner_busy_s:.0f}s of {r.learner_wall_s:.0f}s ({util}); groups: "
            f"{r.rollouts.generated} generated, {r.rollouts.trained} trained, {r.rollouts.waiting} waiting; "
            f"rejected: {rejected}; stale {stale}\n{_held_out_line(r)}")


def _held_out_line(r: JobReport) -> str:
    """Held-out accuracy before -> after: what the job learned on problems it never trained on."""
    before, after = r.eval_before, r.eval_after
    if before is None and after is None:
        return "held-out accuracy: not measured (no held-out prompts)"
    latest = after or before
    assert latest is not None
    step = f" at step {latest.step}" if after is not None else ""
    return (f"held-out accuracy ({latest.prompts} prompts never trained on): greedy "
            f"{_num(before.greedy_accuracy if before else None)} -> {_num(latest.greedy_accuracy)}, sampled "
            f"{_num(before.sampled_accuracy if before else None)} -> {_num(latest.sampled_accuracy)}{step}")


def _jobs_report(args: argparse.Namespace) -> int:
    with _client(args) as client:
        report = client.jobs.report(args.job_id)
    if args.json:
        _print_json(report)
    else:
        print(_report_line(report))
    return 0


def _progress(job: JobRead, m: StepMetrics | None, held_out: EvalRead | None = None) -> str:
    stale = _mean_staleness(m) if m is not None else None
    parts = [
        job.id, f"{job.status.value:<9}", f"step {job.step}/{job.spec.max_steps}",
        f"v{job.version}" if job.version is not None else "v-",
        f"reward {_num(job.reward_mean)}",
        f"held-out {_num(held_out.greedy_accuracy)} (step {held_out.step})" if held_out else "held-out -",
        f"staleness {_num(stale, 2)} (S={job.spec.staleness})",
        f"cost ${job.cost.total_usd:.4f}",
    ]
    return "  ".join(parts)


def _mean_staleness(m: StepMetrics) -> float | None:
    total = sum(m.staleness_hist)
    return sum(i * n for i, n in enumerate(m.staleness_hist)) / total if total else None


def _describe(job: JobRead) -> None:
    spec = job.spec
    rows = [
        ("id", job.id), ("name", spec.name),
        ("status", job.status.value + (f" ({job.status_reason})" if job.status_reason else "")),
        ("model", spec.base_model),
        ("task", spec.task.name + (f" {spec.task.params}" if spec.task.params else "")),
        ("step", f"{job.step}/{spec.max_steps}"),
        ("version", "-" if job.version is None else str(job.version)),
        ("staleness S", str(spec.staleness)), ("prompts", str(job.num_prompts)),
        ("reward", _num(job.reward_mean)),
        ("cost", f"${job.cost.total_usd:.4f} (learner ${job.cost.learner_usd:.4f}, "
                 f"workers ${job.cost.workers_usd:.4f})"),
        ("created", job.created_at.isoformat(timespec="seconds")),
        ("started", job.started_at.isoformat(timespec="seconds") if job.started_at else "-"),
        ("finished", job.finished_at.isoformat(timespec="seconds") if job.finished_at else "-"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if not rows:
        print("(none)")


# --------------------------------------------------------------------------------------------------
# Entry point


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except _UsageError as exc:
        print(f"{PROG}: error: {exc} (see {PROG} {args.group} {args.command} --help)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `echo2 jobs list | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:
        return _fail(exc)


def _fail(exc: Exception) -> int:
    from .errors import Echo2Error

    if isinstance(exc, Echo2Error):
        message = str(exc)
    elif isinstance(exc, OSError):
        message = f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc)
    elif isinstance(exc, ValueError):
        message = str(exc)
    else:
        if os.environ.get("ECHO2_DEBUG"):
            raise exc
        message = f"unexpected {type(exc).__name__}: {exc} (set ECHO2_DEBUG=1 for the traceback)"
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
