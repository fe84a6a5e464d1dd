#!/usr/bin/env bash
# The checks for a lent CUDA GPU, in one run that ends within DEADLINE seconds (default 540):
#  1. honest and cheating groups of bench/replay.py drawn by the worker's transformers backend on the GPU, bf16
#     (and float32, fewer), written under $OUT to be judged by the CPU auditor at home
#     (`python bench/replay.py --stage audit --versions .gpuwork/versions --generated FILE...`), and judged here
#     by a bf16 auditor on the GPU; the versions are .gpuwork/versions, carried (`python bench/replay.py --stage
#     generate --versions .gpuwork/versions --generated /tmp/x.json.gz --honest 8 --cheat 8` trains them);
#  2. the gpu-marked tests;
#  3. bench/gpu.py on SHAPES (default smollm2-1.7b) with whatever time is left.
# Wheels of what that machine lacks, carried in .whl/ (scripts/gpu_wheels.sh fetches them), are installed first.
# Everything printed goes to $OUT/log as well.
set -u
OUT=${OUT:-/tmp/echo2-gpu}
DEADLINE=${DEADLINE:-540}
SHAPES=${SHAPES:-smollm2-1.7b}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log") 2>&1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/sdk:$PWD/workers" PYTHONUNBUFFERED=1
left() { echo $((DEADLINE - SECONDS)); }
quiet() { grep --line-buffered -v "Loading weights\|Writing model shards"; }
replay() {  # the first argument: seconds it may take
  local limit=$1; shift
  timeout "$limit" python3 bench/replay.py --versions .gpuwork/versions --no-vllm "$@" 2>&1 | quiet
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
replay 200 --stage generate --device cuda --dtype bfloat16 --generated "$OUT/replay-cuda-bfloat16.json.gz"
replay 90 --stage generate --device cuda --dtype float32 --honest 3000 --cheat 300 \
  --generated "$OUT/replay-cuda-float32.json.gz"
replay 90 --stage audit --auditor-device cuda --auditor-dtype bfloat16 --honest 1000 --cheat 100 \
  --generated "$OUT"/replay-cuda-*.json.gz --out "$OUT/replay-gpu-auditor.json"
timeout 120 python3 -m pytest -m gpu -p no:cacheprovider -q \
  tests/learner/test_gpu.py tests/learner/test_distributed.py tests/tinker/test_session.py tests/workers/test_backends.py
if [ "$(left)" -gt 100 ]; then
  timeout "$(left)" python3 bench/gpu.py --shapes $SHAPES --cpu-audit-s 45 --out "$OUT/gpu.json" 2>&1 | quiet
fi
echo "gpu_check: done at ${SECONDS}s"
