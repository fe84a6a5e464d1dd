#!/usr/bin/env bash
# Create the Tinker venv at <repo>/.venv-tinker: the official `tinker` SDK, unmodified, which the tests in
# tests/tinker/ drive against Echo2 (docs/TINKER.md). Its own venv: it is the client's side, with its own
# pins (pydantic, httpx, protobuf, transformers). With COOKBOOK=1 it also gets tinker-cookbook 0.6.1 and
# what its recipes import (torch, datasets, chz, ...). The cookbook pins tml-renderers>=0.4.1, which is not
# on PyPI (0.2.1 is the latest), and is needed only for Thinking Machines' own models: the cookbook is
# installed without its dependencies and those are installed by name, tml-renderers left out.
# Idempotent (a marker records the pins); ECHO2_TINKER_VENV=... moves it, FORCE=1 rebuilds it.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ECHO2_TINKER_VENV:-$REPO_ROOT/.venv-tinker}"
PYTHON="${PYTHON:-python3.11}"
PIN="tinker==0.38.0"
COOKBOOK_PIN="tinker-cookbook==0.6.1"
COOKBOOK_DEPS=(torch aiohttp blobfile chz cloudpickle datasets pillow pyrage termcolor tiktoken
               math-verify pylatexenc sympy)
WANT="$PIN"
[[ "${COOKBOOK:-0}" == "1" ]] && WANT="$PIN $COOKBOOK_PIN"
MARKER="$VENV/.echo2-tinker-ready"

if [[ "${FORCE:-0}" != "1" && -f "$MARKER" && "$(cat "$MARKER")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    echo "tinker venv already set up at $VENV"
    exit 0
fi
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
rm -f "$MARKER"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "$PIN"
if [[ "${COOKBOOK:-0}" == "1" ]]; then
    "$VENV/bin/python" -m pip install -q "${COOKBOOK_DEPS[@]}"
    "$VENV/bin/python" -m pip install -q --no-deps "$COOKBOOK_PIN"
fi
"$VENV/bin/python" -c "import tinker; print('tinker', tinker.__version__)"
echo "$WANT" > "$MARKER"
