"""Generate groups with the worker's vLLM backend, for bench/audit.py (run it with the vLLM venv's Python):

    .venv-vllm/bin/python bench/vllm_generate.py --model DIR --requests REQ.json --out OUT.json --dtype bfloat16

REQ.json is a list of GenRequest field dicts; OUT.json a list of groups, each a list of samples
{token_ids, logprobs, finish_reason}, in request order.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--requests", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
    from echo2_worker.backends import GenRequest, create_backend

    requests = [GenRequest(**r) for r in json.loads(args.requests.read_text())]
    backend = create_backend("vllm", dtype=args.dtype, max_model_len=512, enforce_eager=True, seed=0)
    try:
        backend.load(args.model)
        groups = []
        for start in range(0, len(requests), 8):  # a lease's worth at a time, as a worker generates
            groups += backend.generate(requests[start:start + 8])
    finally:
        backend.close()
    args.out.write_text(json.dumps([[{"token_ids": s.token_ids, "logprobs": s.logprobs,
                                      "finish_reason": s.finish_reason} for s in g] for g in groups]))


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this file
    main()
