"""Run the vLLM backend in the vLLM venv and dump what it generated as JSON.

Used by tests/workers/test_vllm_backend.py (the main venv has no vllm). Usage:
    .venv-vllm/bin/python tests/workers/vllm_probe.py --model DIR --requests REQ.json --out OUT.json
        [--reload DIR2] [--adapter ADAPTER [--reload-adapter ADAPTER2] [--lora-rank R]]
        [--dtype float32|bfloat16|auto]
REQ.json is a list of GenRequest field dicts. OUT.json holds {"runs": [{"model": DIR, "samples":
[[{token_ids, logprobs, finish_reason, text}, ...], ...]}, ...], "timings": {...}}: one run on
DIR, a second identical run on DIR (determinism), and with --reload a run after an in-place reload.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--requests", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reload", type=Path)
    parser.add_argument("--adapter", type=Path, help="a LoRA adapter folder applied to --model")
    parser.add_argument("--reload-adapter", type=Path, help="with --adapter: swap to this adapter on the same base")
    parser.add_argument("--lora-rank", type=int, help="with --adapter: load the base alone first, as a LoRA job's "
                        "first version, on an engine built for adapters of this rank; then swap the adapter in")
    parser.add_argument("--dtype", default="float32", help='engine dtype; "auto" is bf16 on CPU')
    parser.add_argument("--compile", action="store_true", help="let vLLM compile (slow start on CPU)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default is far more than a test needs

    from echo2_worker.backends import GenRequest, create_backend

    requests = [GenRequest(**r) for r in json.loads(args.requests.read_text())]
    timings: dict[str, float] = {}
    runs = []
    backend = create_backend("vllm", dtype=args.dtype, max_model_len=512, enforce_eager=not args.compile, seed=0)
    try:
        t0 = time.monotonic()
        if args.lora_rank is not None:
            backend.load(args.model, lora_rank=args.lora_rank)
            runs.append({"model": str(args.model), "label": "base", "samples": _dump(backend.generate(requests))})
            engine = backend.llm
            backend.reload(args.model, args.adapter)
            timings["engine_kept"] = float(backend.llm is engine)
        else:
            backend.load(args.model, args.adapter)
        timings["load_s"] = time.monotonic() - t0
        for label in ("first", "repeat"):
            t0 = time.monotonic()
            runs.append({"model": str(args.model), "label": label, "samples": _dump(backend.generate(requests))})
            timings[f"generate_{label}_s"] = time.monotonic() - t0
        if args.reload is not None:
            t0 = time.monotonic()
            backend.reload(args.reload)
            timings["reload_s"] = time.monotonic() - t0
            runs.append({"model": str(args.reload), "label": "reloaded", "samples": _dump(backend.generate(requests))})
        if args.reload_adapter is not None:
            t0 = time.monotonic()
            backend.reload(args.model, args.reload_adapter)
            timings["reload_adapter_s"] = time.monotonic() - t0
            runs.append({"model": str(args.reload_adapter), "label": "reloaded adapter",
                         "samples": _dump(backend.generate(requests))})
    finally:
        backend.close()
    args.out.write_text(json.dumps({"runs": runs, "timings": timings}))


def _dump(groups: list) -> list:
    return [[dataclasses.asdict(s) for s in group] for group in groups]


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this file
    main()
