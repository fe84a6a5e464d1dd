#!/usr/bin/env bash
# Create the verifiers virtual environment at <repo>/.venv-verifiers, where a verifiers environment is
# served to Echo2 (learner/verifiers_host.py). Its own venv: verifiers 0.3 brings ~700 MB (openai,
# datasets, pyarrow, ...) the platform itself does not need. Idempotent (a marker records the pin);
# override the location with ECHO2_VERIFIERS_VENV=..., force a rebuild with FORCE=1.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ECHO2_VERIFIERS_VENV:-$REPO_ROOT/.venv-verifiers}"
PYTHON="${PYTHON:-python3}"
PIN="verifiers==0.3.1"  # the last release with the classic MultiTurnEnv API the host drives
MARKER="$VENV/.echo2-verifiers-ready"

if [[ "${FORCE:-0}" != "1" && -f "$MARKER" && "$(cat "$MARKER")" == "$PIN" && -x "$VENV/bin/python" ]]; then
    echo "verifiers venv already set up at $VENV"
    exit 0
fi
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
rm -f "$MARKER"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$PIN"
"$VENV/bin/python" -c "import verifiers; print('verifiers', verifiers.__version__)"
echo "$PIN" > "$MARKER"
