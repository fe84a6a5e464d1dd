"""Partial rollouts off vs on, in one run, under a long-tailed length distribution: groups wasted as stale
(% of the groups generated) and throughput (samples/s), side by side.

    python bench/partial.py                  # 30 steps per mode
    python bench/partial.py --steps 20
    python bench/partial.py --scale 4        # every length 4x: long samples outlast a version's arrival

Setup, per mode: the real control plane as a subprocess (learner_staleness.control_plane, SQLite), two
real workers (`echo2_worker.loop.Worker`, the transformers backend on CPU, one torch thread, 8 prompts a
lease generated in one backend call) in threads of this process, and a learner emulated over the real
learner protocol: claim R groups for step t (waiting for them), spend T_TRAIN seconds, commit the step,
publish version t + 1 (κ = 1). It trains nothing: every version carries the same weights, so the
workers' swaps, downloads and staleness are real and the generation is the same in both modes.

The long tail comes from the model, not from the bench (learner.tiny.build_long_tail_model): after a
token ending a "short" prompt the model stops with probability 1/8 per token (about 8 tokens) and after
the "#" that ends 10 % of the prompts it keeps writing "#" and stops with probability 1/300 per token
(most run to max_new_tokens = 96: about 10x the tokens). `--scale k` multiplies every
length by k (stop probabilities / k, max_new_tokens x k): at k = 1 a long group's whole generation is
shorter than a version's cycle, so no sample spans two versions; a larger k makes generations outlast
it, which is where continuing a sample on new weights matters. Its logprobs are honest: workers sample it
like any model.

Waste = groups rejected as stale (at submission or at claim) / groups generated; throughput = samples
of the groups trained / wall time from version 0 to the last step.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner_staleness import ADMIN_KEY, activate, control_plane, ok  # noqa: E402 - the same helpers

if TYPE_CHECKING:
    from learner.sources import RolloutSource, WeightSink

GROUP, R, S, T_TRAIN, MAX_NEW, LONG_SHARE = 4, 8, 1, 0.5, 96, 0.1
P_STOP_SHORT, P_STOP_LONG = 1 / 8, 1 / 300


def prompts(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"item": {"prompt": f"what is {rng.randint(0, 99)}+{rng.randint(0, 99)}"
                      + (" #" if rng.random() < LONG_SHARE else "?"), "reference": "0"}} for _ in range(count)]


@dataclass
class Result:
    mode: str
    generated: int = 0
    stale: int = 0
    stale_long: int = 0  # stale groups with a long sample
    trained: int = 0
    wall_s: float = 0.0
    spanning: int = 0
    samples: int = 0
    long_tokens: float = 0.0
    short_tokens: float = 0.0


def run(url: str, work: Path, model: Path, partial: bool, steps: int) -> Result:
    import httpx
    from echo2_worker.backends import create_backend
    from echo2_worker.control import ControlPlane
    from echo2_worker.loop import LoopOptions, Worker
    from echo2_worker.store import VersionStore

    from learner.remote import ControlPlane as LearnerPlane

    def client(token: str) -> httpx.Client:
        return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120)

    admin = client(ADMIN_KEY)
    user = client(ok(admin.post("/v1/users", json={"name": "bench", "role": "user"}), 201)["api_key"])
    spec = {"name": "partial" if partial else "whole", "base_model": str(model), "task": {"name": "exact_match"},
            "prompts": prompts(2000, 0), "partial_rollouts": partial, "staleness": S, "max_steps": steps + 1,
            "eval": {"size": 0}, "checkpoint_every": 100_000,
            "grpo": {"group_size": GROUP, "prompts_per_step": R, "max_new_tokens": MAX_NEW}}
    job_id = ok(user.post("/v1/jobs", json=spec), 201)["id"]
    learner = LearnerPlane(url, ok(admin.post(f"/v1/jobs/{job_id}/learner/token"), 201)["token"], job_id)
    learner.start()
    publish(learner, model, 0)
    provider = client(ok(admin.post("/v1/providers", json={"name": "bench"}), 201)["token"])
    workers = []
    for i in range(2):
        reg = ok(provider.post("/v1/workers", json={"name": f"w{i}"}), 201)
        activate(f"sqlite:///{work / 'echo2.db'}", reg["worker"]["id"], job_id)
        w = Worker(LoopOptions(worker_id=reg["worker"]["id"], data_dir=work / f"w{i}", max_prompts=8,
                               heartbeat_interval_s=1.0),
                   ControlPlane(url, reg["token"]), lambda: create_backend("transformers", device="cpu"),
                   VersionStore(work / f"w{i}" / "versions"))
        threading.Thread(target=w.run, daemon=True).start()
        workers.append(w)
    start = time.monotonic()
    trained = emulate_learner(learner, learner, model, steps)
    res = Result("on" if partial else "off", wall_s=time.monotonic() - start, trained=trained)
    for w in workers:
        w.request_drain()
    time.sleep(3)
    count(res, admin, job_id, work)
    for c in (admin, user, learner, provider):
        c.close()
    return res


def emulate_learner(source: RolloutSource, sink: WeightSink, model: Path, steps: int) -> int:
    """Claim R groups for step t, T_TRAIN seconds of 'training', commit, publish version t + 1."""
    from echo2.protocol import RolloutRewards, StepReport

    trained = 0
    for t in range(steps):
        ids: list[str] = []
        while len(ids) < R:
            ids += [g.rollout_id for g in source.claim(t, R - len(ids), wait_s=10).groups]
        time.sleep(T_TRAIN)
        rewards = [RolloutRewards(rollout_id=i, rewards=[1.0] + [0.0] * (GROUP - 1)) for i in ids]
        source.report(StepReport(step=t, rollout_ids=ids, t_train_s=T_TRAIN, rewards=rewards))
        trained += len(ids) * GROUP
        publish(sink, model, t + 1)
    return trained


def publish(sink: WeightSink, folder: Path, version: int) -> None:
    from echo2.snapshots import build_manifest

    sink.publish([(folder, build_manifest(folder, version, version, 256 * 1024))])


def count(res: Result, admin: Any, job_id: str, work: Path) -> None:
    from sqlalchemy import select

    from api.db import Database
    from api.models import Rollout

    db = Database(f"sqlite:///{work / 'echo2.db'}")
    with db.session() as s:
        rows = list(s.scalars(select(Rollout).where(Rollout.job_id == job_id)))
    db.engine.dispose()
    res.generated = len(rows)
    cut = 40 * MAX_NEW // 96  # between the short mean (8/96 of max_new_tokens) and the long one (about all of it)
    stale = [r for r in rows if r.reject_kind in ("stale_at_submit", "stale_at_claim")]
    res.stale = len(stale)
    res.stale_long = sum(any(len(x["token_ids"]) > cut for x in r.samples) for r in stale)
    samples = [x for r in rows for x in r.samples]
    res.samples = len(samples)
    res.spanning = sum(len(x.get("versions") or []) > 1 for x in samples)
    longs = [len(x["token_ids"]) for x in samples if len(x["token_ids"]) > cut]
    shorts = [len(x["token_ids"]) for x in samples if len(x["token_ids"]) <= cut]
    res.long_tokens = sum(longs) / max(1, len(longs))
    res.short_tokens = sum(shorts) / max(1, len(shorts))


def table(results: list[Result]) -> str:
    rows = ["| partial rollouts | groups generated | stale | waste | trained samples/s | samples spanning 2+ "
            "versions | wall s |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        rows.append(f"| {r.mode} | {r.generated} | {r.stale} | {100 * r.stale / max(1, r.generated):.1f} % "
                    f"| {r.trained / r.wall_s:.1f} | {r.spanning} of {r.samples} | {r.wall_s:.0f} |")
    return "\n".join(rows)


def main() -> None:
    global T_TRAIN, MAX_NEW, P_STOP_SHORT, P_STOP_LONG, S
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--t-train", type=float, default=T_TRAIN, help="seconds the emulated learner spends a step")
    parser.add_argument("--scale", type=int, default=1, help="multiply every length by this (module docstring)")
    parser.add_argument("--staleness", type=int, default=S, help="the jobs' staleness bound S")
    args = parser.parse_args()
    T_TRAIN, S = args.t_train, args.staleness
    MAX_NEW, P_STOP_SHORT, P_STOP_LONG = MAX_NEW * args.scale, P_STOP_SHORT / args.scale, P_STOP_LONG / args.scale
    import logging

    import torch
    from transformers.utils import logging as hf_logging

    from learner.tiny import build_long_tail_model, build_tiny_model

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    logging.basicConfig(level=logging.ERROR)
    print(f"# partial rollouts bench, {date.today()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}; G={GROUP}, R={R}, S={S}, κ=1, T_train={T_TRAIN}s, max_new_tokens={MAX_NEW}, "
          f"{LONG_SHARE:.0%} long prompts, {args.steps} steps per mode", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="echo2-bench-partial-") as tmp:
        root = Path(tmp)
        model = build_long_tail_model(build_tiny_model(root / "tiny", seed=0), root / "model",
                                      p_stop_short=P_STOP_SHORT, p_stop_long=P_STOP_LONG)
        for partial in (False, True):
            work = root / ("on" if partial else "off")
            work.mkdir()
            with control_plane(work) as url:
                res = run(url, work, model, partial, args.steps)
            results.append(res)
            print(f"partial {res.mode}: {res.generated} groups, {res.stale} stale ({res.stale_long} of them with a "
                  f"long sample), {res.wall_s:.0f}s; mean tokens of short samples {res.short_tokens:.1f}, of long "
                  f"ones {res.long_tokens:.1f}", flush=True)
    print()
    print(table(results))


if __name__ == "__main__":
    main()
