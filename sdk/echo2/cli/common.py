"""What every command shares: the parser class, the connection options, the client and JSON output."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from ..client import Client

PROG = "echo2"


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage itself is one `--help` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class UsageError(Exception):
    """A command line that parses but does not make sense (exit status 2)."""


def connection_options(top: bool) -> Parser:
    """--base-url/--api-key/--request-timeout, accepted before or after the subcommand."""
    parent = Parser(add_help=False)
    # Below the top level the default is SUPPRESS, so an option given before the subcommand survives.
    default: Any = None if top else argparse.SUPPRESS
    group = parent.add_argument_group("connection")
    group.add_argument("--base-url", default=default, metavar="URL",
                       help="Echo2 server URL (default: $ECHO2_BASE_URL)")
    group.add_argument("--api-key", default=default, metavar="KEY", help="API key (default: $ECHO2_API_KEY)")
    group.add_argument("--request-timeout", type=float, default=default, metavar="SECONDS",
                       help="per-request timeout (default: 60)")
    return parent


def key_value(text: str) -> tuple[str, Any]:
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


def connect(args: argparse.Namespace) -> Client:
    from ..client import Client

    return Client(base_url=args.base_url, api_key=args.api_key, timeout=args.request_timeout)


def print_json(model: Any) -> None:
    print(model.model_dump_json(indent=2))
