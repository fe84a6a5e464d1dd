"""A real model learns through the whole platform, measured on problems it never trained on.

    python bench/smollm2_learns.py                       # S = 2, 120 steps
    python bench/smollm2_learns.py --staleness 0 --steps 60

`echo2-server up` (server/stack.py: private Redis, the API, the Celery scheduler, a learner host, local
CPU workers) runs the demo's SmolLM2 job (server/demo.py: SMOLLM2_TWO_DIGIT) on SmolLM2-135M-Instruct (the
packaged GGUF, converted once to an HF folder): two-digit addition ("what is 37+45?" with the model's
chat template; 8,100 problems, 20 % of them held out and never trained on), G = 8, 8 prompts per step,
16 new tokens, lr 2e-6, Adam betas 0.9/0.99, float32 versions (see server/demo.py for why not bf16). The learner
evaluates `--eval-size` held-out problems greedy and sampled at temperature 1 before the first step, every
`--eval-every` steps and after the last.
Reported: that held-out curve, the training reward by blocks of 10 steps, and the wall time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def spec(args: argparse.Namespace) -> dict[str, Any]:
    from server.demo import demo_spec

    job = demo_spec("smollm2", args.steps, args.staleness)
    job["name"] = f"smollm2-two-digit-S{args.staleness}"
    job["eval"] = {"size": args.eval_size, "every": args.eval_every}
    job["grpo"]["lr"] = args.lr
    job["weights"]["dtype"] = args.dtype
    return job


def run(args: argparse.Namespace) -> None:
    from echo2 import Client

    from api.settings import Settings
    from server.local import free_port
    from server.stack import Stack, exit_on_sigterm
    work = Path(tempfile.mkdtemp(prefix="echo2-smollm2-"))
    exit_on_sigterm()
    stack = Stack(Settings(data_dir=work / ".echo2", port=free_port()), workers=args.workers).start()
    try:
        with Client(base_url=stack.url, api_key=stack.admin_key, timeout=60) as client:
            start = time.monotonic()
            job = client.jobs.create(spec(args))
            print(f"{job.id}: {args.steps} steps, S={args.staleness}, {args.workers} CPU worker(s)", flush=True)
            seen = 0
            while not client.jobs.get(job.id).status.is_terminal():
                seen = _print_evals(client, job.id, seen, start)
                time.sleep(5)
            _print_evals(client, job.id, seen, start)
            _summary(client, job.id, time.monotonic() - start)
    finally:
        stack.stop()


def _print_evals(client: Any, job_id: str, seen: int, start: float) -> int:
    evals = client.jobs.evals(job_id)
    for e in evals[seen:]:
        print(f"held-out at step {e.step:4d}: greedy {e.greedy_accuracy:.3f}  sampled {e.sampled_accuracy:.3f}  "
              f"({e.prompts} problems, {e.seconds:.0f} s to evaluate; {time.monotonic() - start:.0f} s in)",
              flush=True)
    return len(evals)


def _summary(client: Any, job_id: str, wall_s: float) -> None:
    job = client.jobs.get(job_id)
    rewards = [m.reward_mean or 0.0 for m in client.jobs.metrics(job_id)]
    for b in range(0, len(rewards), 10):
        print(f"training reward, steps {b + 1:3d}-{min(b + 10, len(rewards)):3d}: "
              f"{statistics.mean(rewards[b:b + 10]):.3f}")
    report = client.jobs.report(job_id)
    print(f"{job.status.value} at step {job.step} in {wall_s / 60:.1f} min; rollout groups "
          f"{report.rollouts.generated} generated, {report.rollouts.trained} trained, "
          f"stale {report.stale_fraction or 0:.1%}" + (f"; {job.status_reason}" if job.status_reason else ""))


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--workers", type=int, default=1, help="CPU workers (transformers)")
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                   help="published weights (the demo's float32; auto: the base model's own, bf16)")
    p.add_argument("--eval-size", type=int, default=100, help="held-out problems per evaluation")
    p.add_argument("--eval-every", type=int, default=20)
    return p.parse_args()


if __name__ == "__main__":
    run(_parse())
