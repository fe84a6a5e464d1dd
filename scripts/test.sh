#!/usr/bin/env bash
# Set up everything the tests need on a fresh machine, then run lint and the whole test suite.
# PostgreSQL comes from Debian (installed here when missing and we are root); the tests start their
# own private cluster and Redis on loopback. Extra pytest arguments pass through.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# The vLLM and tinker venvs download from PyPI while the main venv and the Debian packages install:
# on a fresh clone this takes about two minutes off the setup. Their logs are shown when they fail.
LOGS="$(mktemp -d)"
bash scripts/setup_vllm_venv.sh >"$LOGS/vllm.log" 2>&1 &
VLLM_SETUP=$!
bash scripts/setup_tinker_venv.sh >"$LOGS/tinker.log" 2>&1 &  # the unmodified tinker SDK tests/tinker drives
TINKER_SETUP=$!
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
joined() {  # wait for a background venv setup; its log, and on failure the exit
    if ! wait "$2"; then
        cat "$LOGS/$1.log" >&2
        echo "setting up the $1 venv failed (its log is above)" >&2
        exit 1
    fi
    cat "$LOGS/$1.log"
}
joined vllm "$VLLM_SETUP"
joined tinker "$TINKER_SETUP"

"$ROOT/.venv/bin/ruff" check .
# Long learning runs (marked slow) are benchmarks in all but name: left out unless asked for (-m slow).
# Two test processes (pytest-xdist; ECHO2_TEST_PROCESSES=1 for one): most tests wait on HTTP, processes
# or a database, so two share two cores well: on this project's 2-core machine, 886 tests took 22.4 min
# in two processes; 831 of them had taken 28.7 min in one.
# --dist loadgroup: tests marked xdist_group run in one process (the vLLM backend's).
exec "$PY" -m pytest -ra --durations=15 -n "${ECHO2_TEST_PROCESSES:-2}" --dist loadgroup -m "not slow" "$@"
