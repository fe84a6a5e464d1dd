"""Money: `echo2 jobs estimate`, `echo2 jobs ledger`, `echo2 providers statement`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .common import Parser, UsageError, connect, key_value, print_json
from .render import more, num, table, when
from .spec import named, read_spec, set_path


def add_money(groups: Any, jobs: Any, conn: Parser) -> None:
    """estimate and ledger under `jobs`; the `providers` group."""
    estimate = jobs.add_parser("estimate", parents=[conn], help="estimate a job's cost before submitting it",
                               description="What a job spec would cost; nothing is created. Learner time comes "
                                           "from earlier jobs like it, workers from the set the capacity rule "
                                           "would activate now; the assumptions are printed with the figures.")
    estimate.add_argument("--spec", "--file", "-f", dest="file", required=True, metavar="SPEC.json",
                          help="job spec as JSON ('-' for stdin), as `jobs submit --file` reads it")
    estimate.add_argument("--set", action="append", type=key_value, default=[], dest="sets",
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
    _add_providers(groups, conn)


def _add_providers(groups: Any, conn: Parser) -> None:
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
    spec = read_spec(args.file)
    for path, value in args.sets:
        set_path(spec, path, value)
    with connect(args) as client:
        e = client.jobs.estimate(named(spec))  # named as `jobs submit` names it: the estimate needs a whole spec
    if args.json:
        print_json(e)
        return 0
    print(f"estimate ${e.cost_usd:.4f}: learner ${e.learner_usd:.4f} (${e.learner_price_per_hour:.2f}/h), workers "
          f"${e.workers_usd:.4f} (${e.workers_price_per_hour:.2f}/h) over {e.wall_s:.0f} s, {e.step_s:.2f} s a step")
    table(["WORKER", "NAME", "PRICE", "GROUPS/S", "FRESH", "RATE FROM"],
          [[w.worker_id, w.name, f"${w.price_per_hour:.2f}/h", num(w.mu), "yes" if w.fresh else "no",
            w.mu_source] for w in e.workers])
    for line in e.assumptions:
        print(f"- {line}")
    return 0


def _jobs_ledger(args: argparse.Namespace) -> int:
    with connect(args) as client:
        ledger = client.jobs.ledger(args.job_id, limit=args.limit, offset=args.offset)
    if args.json:
        print_json(ledger)
        return 0
    table(["TIME", "KIND", "WORKER", "STEP", "SECONDS", "AMOUNT", "MEMO"],
          [[when(e.created_at), e.kind.value, e.worker_id or "-", "-" if e.step is None else e.step,
            f"{e.seconds:.1f}", f"${e.amount_usd:.6f}", e.memo or ""] for e in ledger.entries])
    more(args.offset, len(ledger.entries), ledger.total_entries, ledger.next_offset)
    kinds = ", ".join(f"{t.key} ${t.amount_usd:.4f}" for t in ledger.by_kind) or "nothing yet"
    print(f"total ${ledger.total_usd:.4f} ({kinds}); the job's cost ${ledger.cost.total_usd:.4f}")
    return 0


def _providers_statement(args: argparse.Namespace) -> int:
    from ..errors import PermissionDeniedError

    try:
        return _statement(args)
    except PermissionDeniedError as exc:
        if args.provider is not None:
            raise
        raise UsageError(f"{exc}: your own statement needs your provider token as the API key; with an admin key, "
                         "name the provider with --provider PROVIDER_ID") from None


def _statement(args: argparse.Namespace) -> int:
    with connect(args) as client:
        if args.csv:
            sys.stdout.write(client.providers.statement_csv(args.provider, since=args.since, until=args.until,
                                                            limit=args.limit, offset=args.offset))
            return 0
        st = client.providers.statement(args.provider, since=args.since, until=args.until, limit=args.limit,
                                        offset=args.offset)
    if args.json:
        print_json(st)
        return 0
    table(["TIME", "WORKER", "JOB", "STEP", "GROUPS", "SECONDS", "AMOUNT", "MEMO"],
          [[when(e.created_at), e.worker_id or "-", e.job_id, "-" if e.step is None else e.step, e.groups,
            f"{e.seconds:.1f}", f"${e.amount_usd:.6f}", e.memo or ""] for e in st.entries])
    more(args.offset, len(st.entries), st.total_entries, st.next_offset)
    for title, totals in (("WORKER", st.by_worker), ("JOB", st.by_job)):
        print()
        table([title, "ENTRIES", "GROUPS", "SECONDS", "AMOUNT"],
              [[t.key, t.entries, t.groups, f"{t.seconds:.1f}", f"${t.amount_usd:.4f}"] for t in totals])
    print(f"\ntotal ${st.total_usd:.4f} in the period; earnings ${st.earnings_usd:.4f} since sign-up")
    return 0
