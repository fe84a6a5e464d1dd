#!/usr/bin/env bash
# Set up on a fresh machine, then run the whole platform locally on the embedded defaults (SQLite and
# a private Redis under .echo2/) and train the demo job, following it live. Extra arguments go to
# `echo2-server demo` (e.g. --model smollm2, --workers 3, --steps 50).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec "$ROOT/.venv/bin/echo2-server" demo "$@"
