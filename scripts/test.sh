#!/usr/bin/env bash
# Set up everything the tests need on a fresh machine, then run lint and the whole test suite.
# PostgreSQL comes from Debian (installed here when missing and we are root); the tests start their
# own private cluster and Redis on loopback. Extra pytest arguments pass through.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
PY="$ROOT/.venv/bin/python"

if ! command -v initdb >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    if [[ $(id -u) -eq 0 ]]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    else
        echo "PostgreSQL is missing: apt-get install postgresql (the PostgreSQL half of the suite needs it)" >&2
    fi
fi
bash scripts/setup_vllm_venv.sh

"$ROOT/.venv/bin/ruff" check .
exec "$PY" -m pytest -ra "$@"
