"""A LoRA job next to full fine-tuning, through the whole platform and real workers on both backends:
reward curves and bytes per version, side by side in one run.

    python bench/lora.py                     # 120 steps each, 2 transformers workers + 1 vLLM worker
    python bench/lora.py --steps 60 --no-vllm

Each run is `echo2-server up` (server/stack.py: private Redis, the API, the Celery scheduler, a learner
host, local CPU workers) with the demo's job on the tiny model (S = 2); the LoRA run adds
`lora` (rank 16 on every linear layer of the attention and the MLP; the random-init toy model has no
features for attention-only adapters to reuse) and a learning rate of 1e-3, which in-process trials
picked over 3e-4 (slower) and 3e-3 (no learning). With `--vllm` (default when .venv-vllm exists) a
third worker runs the vLLM backend from the vLLM venv. Reported: the mean reward of each block of 10
steps (the step's training samples; the demo task has 25 distinct problems, so this is training
accuracy), the bytes of each version in the form workers fetch in steady state (a LoRA version is its
adapter; a full version its delta when one was published, else the whole model), and how many trained
rollouts each worker's backend produced.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from echo2.client import every

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
LORA = {"rank": 16, "alpha": 32.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def run(name: str, args: argparse.Namespace, lora: bool) -> dict[str, Any]:
    from echo2 import Client

    from api.settings import Settings
    from server.demo import demo_spec
    from server.local import free_port
    from server.stack import Stack, exit_on_sigterm

    work = Path(tempfile.mkdtemp(prefix=f"echo2-lora-{name}-"))
    exit_on_sigterm()
    stack = Stack(Settings(data_dir=work / ".echo2", port=free_port()), workers=args.workers).start()
    try:
        if args.vllm:
            stack.add_worker(str(VLLM_PYTHON), backend="vllm")
        spec = demo_spec("tiny", args.steps, args.staleness)
        if lora:
            spec["lora"], spec["grpo"]["lr"] = LORA, 1e-3
        with Client(base_url=stack.url, api_key=stack.admin_key, timeout=60) as client:
            start = time.monotonic()
            job = client.jobs.create(spec)
            while not client.jobs.get(job.id).status.is_terminal():
                time.sleep(2)
            return _figures(client, job.id, time.monotonic() - start)
    finally:
        stack.stop()


def _figures(client: Any, job_id: str, wall_s: float) -> dict[str, Any]:
    job = client.jobs.get(job_id)
    rewards = [m.reward_mean or 0.0 for m in client.jobs.metrics(job_id)]
    versions = client.checkpoints.versions(job_id)
    steady = [v.delta_size or v.total_size for v in versions[1:-1] if (v.delta_size or v.total_size)]
    workers = {w.id: w for w in client.workers.list(job_id=None, limit=200).items}
    trained = [r for r in every(lambda o: client.jobs.rollouts(job_id, status="trained", limit=200, offset=o))]
    by_backend: dict[str, int] = {}
    for r in trained:
        backend = workers[r.worker_id].backends[0].value if r.worker_id in workers else "?"
        by_backend[backend] = by_backend.get(backend, 0) + 1
    return {"status": job.status.value, "steps": job.step, "wall_s": wall_s, "rewards": rewards,
            "v0_bytes": versions[0].total_size, "steady_bytes": statistics.median(steady) if steady else None,
            "adapter": any(v.adapter for v in versions), "by_backend": by_backend}


def main() -> None:
    args = _parse()
    results = {name: run(name, args, lora) for name, lora in (("full", False), ("lora", True))}
    blocks = max(len(r["rewards"]) for r in results.values()) // 10
    print(f"{args.steps} steps each, S={args.staleness}, {args.workers} transformers workers"
          + (" + 1 vLLM worker" if args.vllm else ""))
    print(f"{'steps':>9} " + " ".join(f"{name:>7}" for name in results))
    for b in range(blocks):
        cells = [statistics.mean(r["rewards"][10 * b: 10 * b + 10]) if len(r["rewards"]) > 10 * b else float("nan")
                 for r in results.values()]
        print(f"{10 * b + 1:>4}-{10 * b + 10:<4} " + " ".join(f"{c:>7.3f}" for c in cells))
    for name, r in results.items():
        steady = f"{r['steady_bytes'] / 1e3:.1f} kB" if r["steady_bytes"] else "-"
        print(f"{name}: {r['status']} at step {r['steps']} in {r['wall_s']:.0f} s; version 0 "
              f"{r['v0_bytes'] / 1e3:.1f} kB, steady-state version {steady} "
              f"({'adapter' if r['adapter'] else 'model or delta'}); trained rollouts by backend {r['by_backend']}")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--workers", type=int, default=2, help="transformers workers")
    p.add_argument("--no-vllm", dest="vllm", action="store_false", help="no vLLM worker")
    args = p.parse_args()
    args.vllm = args.vllm and VLLM_PYTHON.exists()
    return args


if __name__ == "__main__":
    main()
