"""Learning under bounded staleness: the demo arithmetic job at S = 0, 1, 2, 4, side by side.

    python bench/learner_staleness.py                      # S = 0 1 2 4, 150 steps max each
    python bench/learner_staleness.py --staleness 0 2 --max-steps 100

Setup, per S: the real control plane as a subprocess (`python -m server.cli api`, SQLite), one job with
the demo's spec (`server.demo.demo_spec`: tasks/arithmetic.py DEMO_DEFAULTS, built-in
`echo2:tiny`, κ = 1; checkpoints off), the real learner (`learner.loop.Learner`, one torch thread)
in a thread of this process, and two rollout workers (`tests/rollout_driver.RolloutDriver`, the
transformers backend on CPU) activated on the job the way the scheduler does. For S > 0 the workers
hold a version up to `lag = S` steps older than the newest, so the rollouts really are up to S
versions old (still admissible); for S = 0 they generate with the newest version only.

Reported per S: steps to target (number of steps trained when the 3-step mean of the per-step mean
reward first reaches the target, 0.8), wall time to target (from the learner's start, model load and
version 0 included), final reward (mean of the last 3 steps), learner utilisation (the learner's own
counters: seconds inside `GRPOTrainer.step` / wall seconds since it started, what it heartbeats as
`learner_utilization`), the observed staleness, and ratios against S = 0 of the same run.
Everything (server, learner, both workers) shares the machine's cores, so absolute times depend on
the machine's load; the ratios come from runs made back to back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.rollout_driver: the rollout producer of the learner tests

ADMIN_KEY = "e2u_bench-admin-key-0123456789abcdef0123456789"
TARGET = 0.8
WINDOW = 3


@contextmanager
def control_plane(work: Path):  # type: ignore[no-untyped-def]
    """`python -m server.cli api` as a subprocess (it migrates, ensures the admin, runs one uvicorn)."""
    from server.local import free_port, wait_port

    port = free_port()
    env = {**os.environ, "ECHO2_DATABASE_URL": f"sqlite:///{work / 'echo2.db'}", "ECHO2_DATA_DIR": str(work),
           "ECHO2_PORT": str(port), "ECHO2_HOST": "127.0.0.1", "ECHO2_BOOTSTRAP_API_KEY": ADMIN_KEY,
           "ECHO2_LOG_LEVEL": "WARNING", "ECHO2_HEARTBEAT_INTERVAL_S": "1"}
    log = open(work / "server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "api"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO, start_new_session=True)
    try:
        wait_port(port, timeout=120, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def ok(response: Any, status: int = 200) -> Any:
    if response.status_code != status:
        raise RuntimeError(f"{response.request.method} {response.request.url.path}: "
                           f"{response.status_code} {response.text[:300]}")
    return response.json() if response.content else None


def activate(db_url: str, worker_id: str, job_id: str) -> None:
    """What the scheduler does when it picks a worker for a job."""
    from api.db import Database
    from api.models import Job, Worker
    from api.services.fleet import assign
    from api.settings import get_settings

    db = Database(db_url)
    with db.session() as s:
        worker, job = s.get(Worker, worker_id), s.get(Job, job_id)
        assert worker is not None and job is not None
        assign(s, worker, job, get_settings())
        s.commit()
    db.engine.dispose()


def bench_spec(staleness: int, max_steps: int) -> dict[str, Any]:
    """The demo job (`echo2-server demo`, tiny model); checkpoints off, they are not what is measured."""
    from server.demo import demo_spec

    return {**demo_spec("tiny", max_steps, staleness), "name": f"bench-s{staleness}", "checkpoint_every": 1000}


@dataclass
class RunResult:
    staleness: int
    steps: int = 0
    steps_to_target: int | None = None
    wall_to_target_s: float | None = None
    final_reward: float | None = None
    first_reward: float | None = None
    utilisation: float = 0.0
    wall_s: float = 0.0
    busy_s: float = 0.0
    mean_staleness: float = 0.0
    hist: list[int] = field(default_factory=list)
    status: str = ""


def run_one(base_url: str, db_url: str, work: Path, staleness: int, max_steps: int, timeout_s: float) -> RunResult:
    import httpx

    from learner.loop import Learner, LearnerOptions
    from learner.remote import ControlPlane
    from tests.rollout_driver import RolloutDriver

    admin = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
    user_body = ok(admin.post("/v1/users", json={"name": f"bench-s{staleness}", "role": "user"}), 201)
    user = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {user_body['api_key']}"}, timeout=60)
    job = ok(user.post("/v1/jobs", json=bench_spec(staleness, max_steps)), 201)
    job_id = job["id"]
    token = ok(admin.post(f"/v1/jobs/{job_id}/learner/token"), 201)["token"]
    plane = ControlPlane(base_url, token, job_id)
    learner = Learner(plane, LearnerOptions(work_dir=work / "learner", heartbeat_s=1.0, threads=1))
    t0 = datetime.now(UTC)
    thread = threading.Thread(target=learner.run, name="learner", daemon=True)
    thread.start()

    provider = ok(admin.post("/v1/providers", json={"name": f"bench-s{staleness}"}), 201)["token"]
    prov = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {provider}"}, timeout=60)
    drivers = []
    for i in range(2):
        body = ok(prov.post("/v1/workers", json={"name": f"s{staleness}-w{i}"}), 201)
        activate(db_url, body["worker"]["id"], job_id)
        drivers.append(RolloutDriver(base_url, body["worker"]["id"], body["token"], work / f"w{i}",
                                     lag=staleness).start())

    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    if thread.is_alive():  # bounded: cancel, the learner sees the terminal status and returns
        ok(user.post(f"/v1/jobs/{job_id}/cancel"))
        thread.join(timeout=60)
    end = time.monotonic()
    for d in drivers:
        d.stop()
    plane.close()

    res = RunResult(staleness=staleness, busy_s=learner.busy_s, wall_s=end - learner.started)
    res.utilisation = learner.busy_s / res.wall_s
    res.status = ok(user.get(f"/v1/jobs/{job_id}"))["status"]
    metrics = sorted(ok(user.get(f"/v1/jobs/{job_id}/metrics")), key=lambda m: m["step"])
    _summarise(res, metrics, t0)
    for c in (admin, user, prov):
        c.close()
    return res


def _summarise(res: RunResult, metrics: list[dict[str, Any]], t0: datetime) -> None:
    curve = [m["reward_mean"] if m["reward_mean"] is not None else 0.0 for m in metrics]
    res.steps = len(metrics)
    if not curve:
        return
    res.first_reward = curve[0]
    res.final_reward = statistics.fmean(curve[-WINDOW:])
    for i in range(WINDOW - 1, len(curve)):
        if statistics.fmean(curve[i - WINDOW + 1:i + 1]) >= TARGET:
            res.steps_to_target = i + 1
            at = datetime.fromisoformat(metrics[i]["created_at"])
            at = at if at.tzinfo else at.replace(tzinfo=UTC)
            res.wall_to_target_s = (at - t0).total_seconds()
            break
    hist = [0] * (res.staleness + 1)
    for m in metrics:
        for k, n in enumerate(m["staleness_hist"]):
            hist[k] += n
    res.hist = hist
    res.mean_staleness = sum(k * n for k, n in enumerate(hist)) / max(1, sum(hist))


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _ratio(x: float | None, base: float | None) -> str:
    return "—" if x is None or not base else f"{x / base:.2f}"


def table(results: list[RunResult]) -> str:
    base = next((r for r in results if r.staleness == 0), None)
    rows = ["| S | steps run | steps to target | ×S=0 | wall to target s | ×S=0 | first reward | final reward "
            "| learner utilisation | ×S=0 | mean staleness | staleness hist | status |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in results:
        rows.append(
            f"| {r.staleness} | {r.steps} | {r.steps_to_target or 'not reached'} "
            f"| {_ratio(r.steps_to_target, base.steps_to_target if base else None)} "
            f"| {_fmt(r.wall_to_target_s, '.0f')} "
            f"| {_ratio(r.wall_to_target_s, base.wall_to_target_s if base else None)} "
            f"| {_fmt(r.first_reward, '.3f')} | {_fmt(r.final_reward, '.3f')} | {r.utilisation:.2f} "
            f"| {_ratio(r.utilisation, base.utilisation if base else None)} | {r.mean_staleness:.2f} "
            f"| {' / '.join(map(str, r.hist))} | {r.status} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per run before it is cancelled")
    args = parser.parse_args()

    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the workers reload a version every step
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print(f"# learner staleness bench, {date.today()}, {os.cpu_count()} CPUs, "
          f"load average at start {os.getloadavg()[0]:.2f} / {os.getloadavg()[1]:.2f} / {os.getloadavg()[2]:.2f}",
          flush=True)
    results = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="echo2-bench-staleness-") as tmp:
        root = Path(tmp)
        for s in args.staleness:
            work = root / f"s{s}"
            work.mkdir()
            with control_plane(work) as url:
                t = time.monotonic()
                res = run_one(url, f"sqlite:///{work / 'echo2.db'}", work, s, args.max_steps, args.timeout)
            results.append(res)
            print(f"S={s}: {res.steps} steps in {time.monotonic() - t:.0f}s, target at step "
                  f"{res.steps_to_target}, final reward {_fmt(res.final_reward, '.3f')}, "
                  f"utilisation {res.utilisation:.2f}, load average {os.getloadavg()[0]:.2f}", flush=True)
    print()
    print(table(results))
    la = os.getloadavg()
    print(f"\ntotal {time.monotonic() - started:.0f}s; load average at end {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}")


if __name__ == "__main__":
    main()
