#!/usr/bin/env bash
# The checks for a lent CUDA GPU, in one run that ends within DEADLINE seconds (default 540): bench/gpu.py on
# the 135M and 1.7B shapes, the gpu-marked tests, then the 7B shape with whatever time is left. Figures and
# logs go under $OUT. Wheels of what that machine lacks, carried in .whl/ (scripts/gpu_wheels.sh fetches them),
# are installed first.
set -u
OUT=${OUT:-/tmp/echo2-gpu}
DEADLINE=${DEADLINE:-540}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/sdk:$PWD/workers" PYTHONUNBUFFERED=1
left() { echo $((DEADLINE - SECONDS)); }
quiet() { grep --line-buffered -v "Loading weights\|Writing model shards"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout "$(( $(left) - 150 ))" python3 bench/gpu.py --shapes smollm2-135m smollm2-1.7b --out "$OUT/gpu.json" 2>&1 \
  | quiet | tee "$OUT/bench.log"
timeout "$(( $(left) < 150 ? $(left) : 150 ))" python3 -m pytest -m gpu -p no:cacheprovider -q \
  tests/learner/test_gpu.py tests/learner/test_distributed.py tests/tinker/test_session.py \
  tests/workers/test_backends.py 2>&1 | tee "$OUT/tests.log"
if [ "$(left)" -gt 120 ]; then
  timeout "$(left)" python3 bench/gpu.py --shapes qwen2.5-7b --out "$OUT/gpu-7b.json" 2>&1 | quiet \
    | tee "$OUT/bench-7b.log"
fi
echo "gpu_check: done at ${SECONDS}s"
