"""Generate groups with the worker's vLLM backend, for bench/audit.py and bench/replay.py (run it with the vLLM
venv's Python):

    .venv-vllm/bin/python bench/vllm_generate.py --model DIR --requests REQ.json --out OUT.json --dtype bfloat16
    .venv-vllm/bin/python bench/vllm_generate.py --jobs JOBS.json --dtype float32

REQ.json is a list of GenRequest field dicts; OUT.json a list of groups, each a list of samples
{token_ids, logprobs, finish_reason}, in request order. JOBS.json is a list of {"model", "requests", "out"}
(paths) run in one engine, which reloads each model's weights in place as a worker does.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path)
    parser.add_argument("--requests", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--jobs", type=Path, help="several (model, requests, out) in one engine")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
    from echo2_worker.backends import create_backend

    jobs = json.loads(args.jobs.read_text()) if args.jobs else [
        {"model": str(args.model), "requests": str(args.requests), "out": str(args.out)}]
    backend = create_backend("vllm", dtype=args.dtype, max_model_len=512, enforce_eager=True, seed=0)
    try:
        for job in jobs:
            (backend.reload if backend.llm is not None else backend.load)(Path(job["model"]))
            _run(backend, Path(job["requests"]), Path(job["out"]))
    finally:
        backend.close()


def _run(backend: object, requests_file: Path, out: Path) -> None:
    from echo2_worker.backends import GenRequest

    requests = [GenRequest(**r) for r in json.loads(requests_file.read_text())]
    groups = []
    for start in range(0, len(requests), 8):  # a lease's worth at a time, as a worker generates
        groups += backend.generate(requests[start:start + 8])  # type: ignore[attr-defined]
    out.write_text(json.dumps([[{"token_ids": s.token_ids, "logprobs": s.logprobs,
                                 "finish_reason": s.finish_reason} for s in g] for g in groups]))


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this file
    main()
