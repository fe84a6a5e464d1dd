#!/usr/bin/env bash
# Wheels (CPython 3.12, x86-64) of what a lent GPU machine's image lacks for scripts/gpu_check.sh: the
# versions this checkout's .venv has, saved under .whl/ (git-ignored through .git/info/exclude), to be
# carried there: the device tool's run with carry [".whl"] and the command `bash scripts/gpu_check.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
NAMES="mako sqlalchemy alembic annotated-types dill fastapi google-re2 jsonschema-rs opentelemetry-api
opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common opentelemetry-exporter-otlp-proto-common
opentelemetry-exporter-otlp-proto-http opentelemetry-proto opentelemetry-sdk opentelemetry-semantic-conventions
platformdirs pydantic pydantic-settings pydantic-core python-dotenv python-multipart sniffio starlette
typing-inspection uvicorn zstandard"
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
mkdir -p .whl
for name in $NAMES; do
  version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$name==$version"
done
du -sh .whl
