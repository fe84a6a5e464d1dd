#!/usr/bin/env bash
# Set up everything the tests need on a fresh machine, then run lint and the whole test suite.
# PostgreSQL comes from Debian (installed here when missing and we are root); the tests start their
# own private cluster and Redis on loopback. Extra pytest arguments pass through.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
PY="$ROOT/.venv/bin/python"

# Debian packages the suite uses: PostgreSQL (the second database) and Chromium (dashboard tests).
missing=()
command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
[[ -x /usr/bin/chromium ]] || missing+=(chromium)
if (( ${#missing[@]} )); then
    if [[ $(id -u) -eq 0 ]]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "missing Debian packages: ${missing[*]} (apt-get install them; their tests fail under CI=true)" >&2
    fi
fi
bash scripts/setup_vllm_venv.sh
bash scripts/setup_tinker_venv.sh  # the unmodified tinker SDK that tests/tinker drives (~1 min)

"$ROOT/.venv/bin/ruff" check .
# Long learning runs (marked slow) are benchmarks in all but name: left out unless asked for (-m slow).
# Two test processes (pytest-xdist; ECHO2_TEST_PROCESSES=1 for one): most tests wait on HTTP, processes
# or a database, so two share two cores well: on this project's 2-core machine, 886 tests took 22.4 min
# in two processes; 831 of them had taken 28.7 min in one.
exec "$PY" -m pytest -ra --durations=15 -n "${ECHO2_TEST_PROCESSES:-2}" -m "not slow" "$@"
