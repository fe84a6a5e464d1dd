#!/usr/bin/env bash
# Set up on a fresh machine and run Echo2 locally on the embedded defaults (SQLite in .echo2/).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec "$ROOT/.venv/bin/echo2-server" api "$@"
