"""The parser for every command, and the entry point that runs one and turns its errors into one line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .assets import add_assets
from .common import PROG, Parser, UsageError, connection_options
from .jobs import add_jobs
from .money import add_money


def build_parser() -> argparse.ArgumentParser:
    conn = connection_options(top=False)
    parser = Parser(prog=PROG, parents=[connection_options(top=True)],
                    description="Echo2: RL post-training jobs on a central learner with distributed rollout "
                                "workers. Configure with ECHO2_BASE_URL and ECHO2_API_KEY.")
    groups = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)
    jobs = add_jobs(groups, conn)
    add_assets(groups, conn)
    add_money(groups, jobs, conn)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse's own error names the top command's help, not the one that has the options
        where = " ".join(str(p) for p in (PROG, getattr(args, "group", None), getattr(args, "command", None)) if p)
        print(f"{PROG}: error: unrecognized arguments: {' '.join(extra)} (see {where} --help)", file=sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except UsageError as exc:
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
    from ..errors import Echo2Error

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
