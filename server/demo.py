"""`echo2-server demo`: `up`, then a real GRPO job on the tiny model (or SmolLM2-135M), followed live
in the terminal, ending with a one-line summary. Exit code 0 when the job succeeded."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from echo2 import Client
from echo2.protocol import JobRead, JobReport, JobStatus

from learner.tasks.arithmetic import DEMO_DEFAULTS

from .stack import Stack

MODELS = {"tiny": "echo2:tiny", "smollm2": "echo2:smollm2"}


def demo_spec(model: str, steps: int | None, staleness: int) -> dict[str, Any]:
    d = DEMO_DEFAULTS
    spec: dict[str, Any] = {
        "name": f"demo-{model}", "base_model": MODELS[model], "staleness": staleness, "publish_period": 1,
        "task": {"name": d["task"], "params": d["task_params"]}, "max_steps": steps or 130, "checkpoint_every": 10,
        # The settings the learning test validated (tests/learner/test_learns.py), all of them.
        "grpo": {"group_size": d["group_size"], "prompts_per_step": d["prompts_per_step"], "lr": d["lr"],
                 "adam_betas": d["adam_betas"], "weight_decay": d["weight_decay"], "max_grad_norm": d["grad_clip"],
                 "max_new_tokens": d["max_new_tokens"], "temperature": d["temperature"], "eps_low": d["eps_low"],
                 "eps_high": d["eps_high"], "ratio_cap": d["ratio_cap"], "kl_coef": d["kl_coef"],
                 "loss_agg": d["length_norm"], "scale_rewards": d["scale_by_std"]},
    }
    if model == "smollm2":
        spec.update(SMOLLM2_TWO_DIGIT, max_steps=steps or 10, checkpoint_every=20)
    return spec


# A real instruct model on a task it half knows: two-digit addition asked as a question (8,100 problems,
# 20 % of them held out), gentle updates, 8 prompts a step on CPU; bench/smollm2_learns.py measures it.
# Versions are the default: bf16 (SmolLM2's own dtype), which the learner computes on (learner/rounding.py).
SMOLLM2_TWO_DIGIT: dict[str, Any] = {
    "task": {"name": "arithmetic", "params": {"min_operand": 10, "max_operand": 99, "style": "question"}},
    "eval": {"size": 100, "every": 10},
    "grpo": {"group_size": 8, "prompts_per_step": 8, "max_new_tokens": 16, "lr": 2e-6, "temperature": 1.0,
             "adam_betas": [0.9, 0.99], "max_grad_norm": 1.0},
}


def run_demo(stack: Stack, model: str, steps: int | None, staleness: int, out: TextIO = sys.stdout) -> int:
    start = time.monotonic()
    with Client(base_url=stack.url, api_key=stack.admin_key, timeout=60) as client:
        job = client.jobs.create(demo_spec(model, steps, staleness))
        print(f"submitted {job.id}: {job.spec.base_model} on {job.spec.task.name}, S={staleness}, "
              f"{job.spec.max_steps} steps; dashboard {stack.url}/jobs/{job.id}", file=out, flush=True)
        rewards = _follow(client, job.id, out)
        final = client.jobs.get(job.id)
        report = client.jobs.report(job.id)
    for line in summary(final, report, rewards, time.monotonic() - start):
        print(line, file=out, flush=True)
    return 0 if final.status is JobStatus.succeeded else 1


def summary(final: JobRead, report: JobReport, rewards: list[float], took: float) -> list[str]:
    first = f"{rewards[0]:.2f}" if rewards else "n/a"
    last = f"{sum(rewards[-3:]) / len(rewards[-3:]):.2f}" if rewards else "n/a"
    stale = f"{report.stale_fraction:.1%}" if report.stale_fraction is not None else "n/a"
    util = f"{report.learner_utilization:.0%}" if report.learner_utilization is not None else "n/a"
    return [
        f"{final.status.value}: held-out accuracy {_held_out(report)}; training reward {first} -> {last} "
        f"(mean of the last 3 steps) in {final.step} steps, {took:.0f}s wall, ${final.cost.total_usd:.4f}"
        + (f" ({final.status_reason})" if final.status_reason else ""),
        "  held-out: the model's greedy answers to problems it never trained on, before and after: what it "
        "learned. Training reward: the mean reward of the samples drawn at temperature "
        f"{final.spec.grpo.temperature:g} for each step's groups, on ever new problems: noisy, and it moves "
        "slowly over a few steps.",
        f"rollout groups: {report.rollouts.generated} generated, {report.rollouts.trained} trained, "
        f"{stale} rejected as stale; learner busy {util} of its wall time",
    ]


def _held_out(report: JobReport) -> str:
    """Greedy accuracy on prompts the job never trained on, before -> after."""
    before, after = report.eval_before, report.eval_after or report.eval_before
    if before is None or after is None:
        return "n/a (no held-out prompts)"
    return (f"{before.greedy_accuracy:.2f} -> {after.greedy_accuracy:.2f} (greedy, {after.prompts} problems never "
            f"trained on; sampled {before.sampled_accuracy:.2f} -> {after.sampled_accuracy:.2f})")


STALENESS_LEGEND = ("staleness a:n = n of the step's groups were made by the policy a versions older than the "
                    "one trained (0: on-policy; at most S)")


def _follow(client: Client, job_id: str, out: TextIO) -> list[float]:
    """Print what the job is doing while it starts (its status and reason when they change) and a line per step."""
    rewards: list[float] = []
    seen, said, start = 0, "", time.monotonic()
    while True:
        job = client.jobs.get(job_id)
        now = job.status.value + (f" ({job.status_reason})" if job.status_reason else "")
        if now != said:
            print(f"[{time.monotonic() - start:4.0f}s] {now}", file=out, flush=True)
            said = now
        for m in client.jobs.metrics(job_id, since_step=seen):
            if seen == 0:
                print(STALENESS_LEGEND, file=out, flush=True)
            rewards.append(m.reward_mean or 0.0)
            seen = m.step + 1
            workers = client.workers.list(job_id=job_id).total
            hist = " ".join(f"{s}:{n}" for s, n in enumerate(m.staleness_hist) if n)
            print(f"step {m.step + 1:4d}/{job.spec.max_steps}  reward {m.reward_mean or 0:.3f}  "
                  f"staleness {hist or '-':12s}  workers {workers}  cost ${m.cost_usd or 0:.4f}", file=out, flush=True)
        if job.status.is_terminal():
            return rewards
        time.sleep(1.0)
