"""Guess-the-number learnt end to end through real workers: multi-turn episodes played through the
control plane, on the tiny model.

    python bench/multiturn.py                      # 40 steps, secrets 1..6, 3 turns, 2 local workers
    python bench/multiturn.py --steps 60 --high 8 --turns 4

The platform runs as `echo2-server up` runs it (server/stack.py). Each sample is an episode: the model
guesses, the control plane's environment answers "higher." / "lower." (the secret stays with it)
until the guess is right or the turns run out; reward 1 when found. Printed per window of steps, from
the rollouts each step trained on: the success rate (the episodes' mean reward, as the environment
scored them), the mean number of model turns per episode, and the mean turns of the episodes that
found the number. A policy that guesses valid numbers at random, without using the hints, finds it
within T turns with probability T / (high - low + 1) (T distinct guesses; fewer if it repeats).
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


def main() -> None:
    args = _parse()
    from echo2 import Client

    from api.db import Database
    from api.settings import Settings
    from server.local import free_port
    from server.stack import Stack, exit_on_sigterm

    work = Path(tempfile.mkdtemp(prefix="echo2-multiturn-"))
    exit_on_sigterm()
    settings = Settings(data_dir=work / ".echo2", port=free_port())
    started = time.monotonic()
    stack = Stack(settings, workers=args.workers).start()
    try:
        with Client(base_url=stack.url, api_key=stack.admin_key, timeout=120) as client:
            job = client.jobs.create(spec(args))
            while not client.jobs.get(job.id).status.is_terminal():
                time.sleep(2.0)
            job = client.jobs.get(job.id)
    finally:
        stack.stop()
    if job.status.value != "succeeded":
        raise SystemExit(f"job {job.id} {job.status.value}: {job.status_reason}")
    _print(args, per_step(Database(settings.database_url), job.id), time.monotonic() - started)


def spec(args: argparse.Namespace) -> dict[str, Any]:
    from tasks.arithmetic import DEMO_DEFAULTS as d

    return {
        "name": "guess-number", "base_model": "echo2:tiny", "staleness": 2, "publish_period": 1,
        "max_steps": args.steps, "checkpoint_every": 20,
        "task": {"name": "guess_number", "params": {"low": args.low, "high": args.high, "max_turns": args.turns}},
        "grpo": {"group_size": d["group_size"], "prompts_per_step": args.prompts, "lr": d["lr"],
                 "adam_betas": d["adam_betas"], "max_grad_norm": d["grad_clip"], "max_new_tokens": 3,
                 "temperature": d["temperature"], "loss_agg": d["length_norm"], "scale_rewards": d["scale_by_std"]},
    }


def per_step(db: Any, job_id: str) -> dict[int, list[tuple[float, int]]]:
    """(reward, model turns) of every episode each step trained on."""
    from sqlalchemy import select

    from api.models import Rollout

    steps: dict[int, list[tuple[float, int]]] = {}
    with db.session() as s:
        for r in s.scalars(select(Rollout).where(Rollout.job_id == job_id, Rollout.status == "trained")):
            for sample, reward in zip(r.samples, r.rewards or [], strict=True):
                steps.setdefault(r.trained_step, []).append((float(reward), (len(sample["turns"]) + 1) // 2))
    return steps


def _print(args: argparse.Namespace, steps: dict[int, list[tuple[float, int]]], total_s: float) -> None:
    size = args.high - args.low + 1
    print(f"guess_number {args.low}..{args.high}, {args.turns} turns, tiny model, {args.steps} steps of "
          f"{args.prompts} prompts x 8 episodes, {args.workers} local workers; random valid guesses would win "
          f"{min(1.0, args.turns / size):.2f}")
    print(f"{'steps':>9} {'episodes':>9} {'success':>8} {'mean turns':>11} {'turns to win':>13}")
    last = max(steps)
    for lo in range(0, last + 1, args.window):
        rows = [e for t in range(lo, min(lo + args.window, last + 1)) for e in steps.get(t, [])]
        wins = [turns for reward, turns in rows if reward > 0]
        print(f"{lo:>4}-{min(lo + args.window - 1, last):<4} {len(rows):>9} "
              f"{statistics.fmean(r for r, _ in rows):>8.3f} {statistics.fmean(t for _, t in rows):>11.2f} "
              f"{statistics.fmean(wins) if wins else float('nan'):>13.2f}")
    print(f"bench wall time {total_s:.0f} s")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--low", type=int, default=1)
    p.add_argument("--high", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16, help="prompts (groups of 8 episodes) per step")
    p.add_argument("--window", type=int, default=5, help="steps per printed row")
    p.add_argument("--workers", type=int, default=2)
    return p.parse_args()


if __name__ == "__main__":
    main()
