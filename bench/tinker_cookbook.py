"""tinker-cookbook's math RL recipe (its arithmetic environment), unchanged, against Echo2's Tinker API.

    COOKBOOK=1 scripts/setup_tinker_venv.sh      # tinker 0.38.0 + tinker-cookbook 0.6.1 in .venv-tinker
    python bench/tinker_cookbook.py              # 24 steps of 16 groups x 8 samples on SmolLM2-135M-Instruct
    python bench/tinker_cookbook.py --async 2    # its async configuration (max_steps_off_policy=2), default loss

`echo2-server up` (server/stack.py) with its Tinker learner host and one local rollout worker (`--workers`),
which draws the recipe's samples once the model's fleet job has it (docs/TINKER.md); then the recipe,
`python -m tinker_cookbook.recipes.math_rl.train`, as a user runs it from .venv-tinker, changed only in its
base URL and its model: SmolLM2-135M-Instruct by folder (the packaged GGUF converted once; nothing is
downloaded). A folder names no renderer, so the renderer is named: SmolLM2 is a ChatML model, and
`qwen3_instruct` renders ChatML and stops at `<|im_end|>`. Synchronous runs name `importance_sampling` (as
before stable_reinforce was served); `--async N` runs the recipe's async configuration (`max_steps_off_policy=N`)
with its default loss, `stable_reinforce`, and the sampling it asks for (`record_stability_info`, provenance
spans). `--loss` names another. The recipe's addition problems are drawn fresh every batch; its reward is 1 for
the right sum, minus 0.1 for a missing stop token. TINKER_PYTHON=... runs the recipe from another venv (one with
the cookbook).
Reported: the recipe's own per-step metrics (reward, fraction correct, staleness in async) from its
metrics.jsonl, by blocks, and the first block against the last; and how many of its sample requests the worker
fleet drew, how many the learner host, and how many groups the host audited.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TINKER_PYTHON = Path(os.environ.get("TINKER_PYTHON", REPO / ".venv-tinker" / "bin" / "python"))
MODEL = REPO / ".echo2-cache" / "smollm2-135m-instruct"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--groups", type=int, default=16, help="groups_per_batch")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--block", type=int, default=5, help="steps per reported block")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the Tinker host")
    p.add_argument("--workers", type=int, default=1, help="local rollout workers (0: every sample on the host)")
    p.add_argument("--async", dest="off_policy", type=int, default=None, metavar="N",
                   help="the recipe's async configuration: max_steps_off_policy=N, its default loss")
    p.add_argument("--loss", default=None, help="loss_fn (default: importance_sampling sync, the recipe's async)")
    args = p.parse_args()
    _check_cookbook()
    model = _model()
    from api.settings import Settings
    from server.local import free_port
    from server.stack import Stack, exit_on_sigterm

    work = Path(tempfile.mkdtemp(prefix="echo2-cookbook-"))
    exit_on_sigterm()
    settings = Settings(data_dir=work / ".echo2", port=free_port(), learner_threads=args.threads)
    stack = Stack(settings, workers=args.workers, tinker_slots=1).start()
    try:
        start = time.monotonic()
        _recipe(stack.url, stack.admin_key, model, args, work / "run")
        wall = time.monotonic() - start
    finally:
        stack.stop()
    _report(work / "run" / "metrics.jsonl", args.block, wall)
    _who_sampled(settings.database_url)


def _check_cookbook() -> None:
    ok = TINKER_PYTHON.exists() and subprocess.run([str(TINKER_PYTHON), "-c", "import tinker_cookbook"],
                                                   capture_output=True).returncode == 0
    if not ok:
        sys.exit("tinker-cookbook is not in .venv-tinker: run COOKBOOK=1 scripts/setup_tinker_venv.sh")


def _model() -> Path:
    if not (MODEL / "config.json").exists():
        from learner.tiny import import_smollm2

        import_smollm2(MODEL)
    return MODEL


def _recipe(url: str, key: str, model: Path, args: argparse.Namespace, log_path: Path) -> None:
    # Synchronous runs name importance_sampling, as the README's command does; async runs keep the recipe's default.
    loss = [f"loss_fn={args.loss}"] if args.loss else ["loss_fn=importance_sampling"] if args.off_policy is None else []
    cmd = [str(TINKER_PYTHON), "-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={model}",
           "renderer_name=qwen3_instruct", *loss, f"base_url={url}",
           "env=arithmetic", f"groups_per_batch={args.groups}", f"group_size={args.group_size}",
           f"max_steps={args.steps}", f"max_tokens={args.max_tokens}", f"learning_rate={args.lr}",
           f"lora_rank={args.rank}", "eval_every=0", "save_every=0", f"log_path={log_path}",
           *([f"max_steps_off_policy={args.off_policy}"] if args.off_policy is not None else [])]
    print(" ".join(cmd[1:]), flush=True)
    env = {**os.environ, "TINKER_API_KEY": f"tml-{key}", "HOME": str(log_path.parent)}
    done = subprocess.run(cmd, env=env, cwd=log_path.parent, stdout=sys.stdout, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"the recipe exited with {done.returncode}")


def _report(metrics: Path, block: int, wall: float) -> None:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    reward = [r["env/all/reward/total"] for r in rows if "env/all/reward/total" in r]
    correct = [r["env/all/correct"] for r in rows if "env/all/correct" in r]
    stale = [r["async/staleness_mean"] for r in rows if "async/staleness_mean" in r]
    print(f"{len(reward)} steps in {wall:.0f} s")
    if stale:
        print(f"staleness (steps between the sampler and the trained weights): mean {statistics.mean(stale):.2f}, "
              f"max {max(r.get('async/staleness_max', 0) for r in rows)}")
    for b in range(0, len(reward), block):
        print(f"steps {b + 1:3d}-{min(b + block, len(reward)):3d}: reward {statistics.mean(reward[b:b + block]):.3f}"
              f"  correct {statistics.mean(correct[b:b + block]):.3f}")
    if len(reward) >= 2 * block:
        print(f"reward, first {block} steps {statistics.mean(reward[:block]):.3f} -> last {block} steps "
              f"{statistics.mean(reward[-block:]):.3f}")


def _who_sampled(database_url: str) -> None:
    from sqlalchemy import func, select

    from api.db import Database
    from api.tinker.models import TinkerRequest

    with Database(database_url).session() as db:
        audits = db.scalar(select(func.count()).where(TinkerRequest.kind == "audit", TinkerRequest.status == "done"))
        samples = list(db.scalars(select(TinkerRequest.result).where(TinkerRequest.kind == "sample",
                                                                      TinkerRequest.status == "done")))
    fleet = sum(1 for r in samples if r and "worker" in r)
    fleet_samples = sum(len(r["sample"]["sequences"]) for r in samples if r and "worker" in r)
    all_samples = sum(len(r["sample"]["sequences"]) for r in samples if r)
    print(f"sample requests: {fleet} drawn by the worker fleet, {len(samples) - fleet} by the learner host; "
          f"samples: {fleet_samples} of {all_samples} drawn by workers; {audits} groups audited by the host")


if __name__ == "__main__":
    main()
