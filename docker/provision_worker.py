"""Sign up the compose stack's own provider once, and leave its token where the worker reads it.

    python /opt/echo2/provision_worker.py --server http://api:8000 --out /run/echo2/provider/token

Authenticates with the admin key in ECHO2_BOOTSTRAP_API_KEY. Idempotent: a token file already there
is kept (the worker re-joins with its saved credentials anyway). The file is written mode 0600,
atomically. Workers on other machines get their own provider token from an admin instead
(`client.providers.create(name)` in the SDK, or POST /v1/providers).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def provision(server: str, out: Path, name: str, api_key: str) -> bool:
    """True when a new provider was created, False when `out` already held a token."""
    if out.exists() and out.read_text().strip():
        return False
    from echo2 import Client
    from echo2.snapshots import atomic_write

    with Client(base_url=server, api_key=api_key) as client:
        created = client.providers.create(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, (created.token + "\n").encode(), mode=0o600)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="provision_worker", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--server", required=True, help="control-plane URL, e.g. http://api:8000")
    parser.add_argument("--out", type=Path, required=True, help="file to write the provider token to")
    parser.add_argument("--name", default="compose-local", help="provider name (default compose-local)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    api_key = os.environ.get("ECHO2_BOOTSTRAP_API_KEY", "")
    if not api_key:
        sys.stderr.write("provision_worker: error: set ECHO2_BOOTSTRAP_API_KEY (an admin API key)\n")
        return 1
    try:
        created = provision(args.server, args.out, args.name, api_key)
    except Exception as exc:  # one line for the operator, no traceback
        sys.stderr.write(f"provision_worker: error: {exc}\n")
        return 1
    sys.stdout.write(f"provider {args.name!r}: token {'written to' if created else 'already at'} {args.out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
