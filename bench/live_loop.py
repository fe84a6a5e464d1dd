"""The live loop against its model: learner utilisation and wasted rollouts when workers are provisioned
by the capacity rule, measured live and predicted by the simulator for the same job, side by side.

    python bench/live_loop.py                       # S = 2, provisioned (1.0) and under-provisioned (0.5)
    python bench/live_loop.py --levels 1.0 --steps 40

Setup. The learner has a core of its own: the real learner process (`python -m server.cli learner`, one
torch thread) is pinned to CPU 0; the real control plane (`python -m server.cli api`, SQLite) and this
process are pinned to CPU 1. The job trains a random-init Qwen2 (bench/publish_overlap.py's builder,
hidden 256, 4 layers) on the arithmetic task, publishing every step (κ = 1). Workers are emulated
threads of this process, each a real HTTP client of the control plane that does what a worker does —
heartbeat, hear of versions (the long-poll), lease under the staleness contract, submit version-tagged
groups — except the generation itself, which it replaces by sleeping 1/μ per group, so a stated rate
μ costs no CPU the learner needs. Its groups are well-formed and carry a training signal (sample 0
holds the right answer, the others a wrong one; logprobs -2.0); since they are not samples of the
model, audits are switched off for this benchmark (ECHO2_AUDIT_RATE=0, ECHO2_PROBATION_AUDITS=0).

Procedure. A calibration run with 1.5 times the workers a first guess needs measures T_train (the
learner's seconds inside a step) and the step overhead (wall per step beyond that, when the learner
never waits). For each level, N = ceil(level · (1 + h) · R / (T_train · μ)) workers — the capacity rule's
throughput condition — then: the live run, and the simulator (planner/sim) fed the same R, S, κ,
steps, N, μ, measured T_train and overhead, notice latency and the learner's claim wait ~0 (both long-poll).
Reported: steady utilisation (training seconds / wall between the first and the last step) and waste
(groups rejected as stale / groups generated), live and simulated.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ADMIN_KEY = "e2u_bench-admin-key-0123456789abcdef0123456789"
HEADROOM = 0.1


@contextmanager
def control_plane(work: Path):  # type: ignore[no-untyped-def]
    from server.local import free_port, wait_port

    port = free_port()
    env = {**os.environ, "ECHO2_DATABASE_URL": f"sqlite:///{work / 'echo2.db'}", "ECHO2_DATA_DIR": str(work),
           "ECHO2_PORT": str(port), "ECHO2_HOST": "127.0.0.1", "ECHO2_BOOTSTRAP_API_KEY": ADMIN_KEY,
           "ECHO2_LOG_LEVEL": "WARNING", "ECHO2_HEARTBEAT_INTERVAL_S": "1", "ECHO2_AUDIT_RATE": "0",
           "ECHO2_PROBATION_AUDITS": "0"}
    with open(work / "server.log", "wb") as log:
        proc = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-m", "server.cli", "api"], env=env,
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        wait_port(port, timeout=120, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class Emulated(threading.Thread):
    """A worker that generates at exactly μ groups/s without computing (see the module docstring).

    As the real worker does, it hears of versions through the long-poll (a notice thread that also
    heartbeats every second, reporting the version as held at once: an instant download, its possession
    challenge answered from the control plane's own probes), leases up
    to LEASE_PROMPTS prompts at a time and hands finished groups to a submit thread, so network round
    trips never hold generation up. Generation runs on a virtual clock, one group at a time (T_gen =
    1/μ, as the simulator models a worker): each is done 1/μ after the previous one was (or after its
    lease came back, when the worker had to wait for one), and submitted at once."""

    LEASE_PROMPTS = 4

    def __init__(self, url: str, worker_id: str, token: str, mu: float, tokenizer: Any, stop: threading.Event,
                 db: Any):
        super().__init__(daemon=True)
        import queue

        import httpx

        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        self.worker_id, self.mu, self.tok, self.stop, self.db = worker_id, mu, tokenizer, stop, db
        self.version: int | None = None  # reported as held
        self.min_version = 0
        self.job_id: str | None = None
        self.groups = 0
        self.outbox: queue.Queue[tuple[str, list[dict[str, Any]] | None]] = queue.Queue()
        self.new_version = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._notices, daemon=True).start()
        threading.Thread(target=self._submitter, daemon=True).start()
        super().start()

    def run(self) -> None:
        free_at = time.monotonic()
        while not self.stop.is_set():
            if self.version is None or self.version < self.min_version or self.job_id is None:
                self.stop.wait(0.02)
                continue
            lease = self._lease()
            if lease is None:
                continue
            free_at = max(free_at, time.monotonic())
            for prompt in lease["prompts"]:  # one group every 1/μ, each submitted as soon as it is done
                if lease["version"] < self.min_version:  # as the real worker: no group that would be stale
                    self.outbox.put((lease["id"], None))  # release the rest
                    break
                free_at += 1 / self.mu
                group = self._group(prompt, lease)
                self.stop.wait(max(0.0, free_at - time.monotonic()))
                self.outbox.put((lease["id"], [group]))

    def _lease(self) -> dict[str, Any] | None:
        r = self.http.post("/v1/leases", json={"job_id": self.job_id, "max_prompts": self.LEASE_PROMPTS,
                                               "version": self.version})
        if r.status_code == 201:
            return r.json()
        wait_ms = float(r.headers.get("Retry-After-Ms", 100)) if r.status_code == 409 else 200
        self.new_version.wait(min(wait_ms / 1000, 1.0))  # as the real worker, a new version ends the wait
        self.new_version.clear()
        return None

    def _notices(self) -> None:
        """Heartbeat every second, and at once when the long-poll announces a new version."""
        while not self.stop.is_set():
            held = [] if self.version is None else [self.version]
            beat = self.http.post(f"/v1/workers/{self.worker_id}/heartbeat",
                                  json={"status": "active", "versions_held": held})
            a = beat.json().get("assignment") if beat.status_code == 200 else None
            if not a:
                self.stop.wait(0.05)
                continue
            self.job_id, self.min_version = a["job_id"], a["min_version"]
            if a["version"] != self.version and a["version"] not in held:
                self.version = None  # report it held in the next beat, then lease with it
                self._report_held(a["version"])
                continue
            self.http.get(f"/v1/jobs/{a['job_id']}/versions/next", params={"after": a["version"], "timeout_s": 1})

    def _report_held(self, version: int) -> None:
        beat = self.http.post(f"/v1/workers/{self.worker_id}/heartbeat",
                              json={"status": "active", "versions_held": [version]})
        a = beat.json().get("assignment") if beat.status_code == 200 else None
        if a and a["challenges"]:
            beat = self.http.post(f"/v1/workers/{self.worker_id}/heartbeat", json={
                "status": "active", "versions_held": [version], "proofs": self._proofs(a["job_id"], a["challenges"])})
        if beat.status_code == 200:
            self.version = version
            self.new_version.set()

    def _proofs(self, job_id: str, challenges: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The answers, read from the probes the learner published: an emulated worker holds no weights."""
        from api.models import WeightVersion

        with self.db.session() as s:
            probes = {c["version"]: s.get(WeightVersion, (job_id, c["version"])).probes for c in challenges}
        return [{**c, "sha256": p["sha256"]} for c in challenges for p in probes[c["version"]]
                if (p["offset"], p["length"]) == (c["offset"], c["length"])]

    def _submitter(self) -> None:
        import queue

        while not self.stop.is_set():
            try:
                lease_id, groups = self.outbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if groups is None:
                self.http.post(f"/v1/leases/{lease_id}/release")
                continue
            self.http.post(f"/v1/leases/{lease_id}/rollouts", json={"groups": groups})
            self.groups += len(groups)

    def _group(self, prompt: dict[str, Any], lease: dict[str, Any]) -> dict[str, Any]:
        from echo2.prompting import encode_prompt

        g, n = lease["sampling"]["group_size"], lease["sampling"]["max_new_tokens"]
        a, op, b = re.match(r"(\d+)([-+*])(\d+)", prompt["text"]).groups()  # type: ignore[union-attr]
        right = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        samples = [self._sample(str(right if k == 0 else right + k), n) for k in range(g)]
        return {"prompt_id": prompt["prompt_id"], "version": lease["version"],
                "prompt_token_ids": encode_prompt(self.tok, prompt["text"]), "samples": samples}

    def _sample(self, answer: str, length: int) -> dict[str, Any]:
        ids = self.tok(answer)["input_ids"][: length - 1]
        ids = ids + self.tok(" ")["input_ids"][:1] * (length - 1 - len(ids)) + [self.tok.eos_token_id]
        return {"token_ids": ids, "logprobs": [-2.0] * len(ids), "finish_reason": "stop"}


def run_live(args: argparse.Namespace, model_dir: Path, n_workers: int, work: Path) -> dict[str, float]:
    import httpx
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    work.mkdir(parents=True, exist_ok=True)
    with control_plane(work) as url:
        admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
        job = admin.post("/v1/jobs", json=_spec(args, model_dir)).json()
        token = admin.post(f"/v1/jobs/{job['id']}/learner/token").json()["token"]
        learner = _start_learner(url, job["id"], token, work)
        stop = threading.Event()
        workers = _emulated(admin, url, f"sqlite:///{work / 'echo2.db'}", job["id"], n_workers, args.mu, tok, stop)
        try:
            learner.wait(timeout=args.timeout)
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=10)
        metrics = admin.get(f"/v1/jobs/{job['id']}/metrics").json()
        report = admin.get(f"/v1/jobs/{job['id']}/report").json()
    return _live_figures(metrics, report)


def _start_learner(url: str, job_id: str, token: str, work: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "ECHO2_LEARNER_TOKEN": token, "ECHO2_LOG_LEVEL": "WARNING"}
    with open(work / "learner.log", "wb") as log:
        return subprocess.Popen(["taskset", "-c", "0", sys.executable, "-m", "server.cli", "learner", "--job", job_id,
                                 "--server", url, "--work-dir", str(work / "learner"), "--threads", "1"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def _emulated(admin: Any, url: str, db_url: str, job_id: str, n: int, mu: float, tok: Any,
              stop: threading.Event) -> list[Emulated]:
    from api.db import Database

    provider, db = admin.post("/v1/providers", json={"name": "emulated"}).json()["token"], Database(db_url)
    workers = []
    for i in range(n):
        body = admin.post("/v1/workers", json={"name": f"e{i}", "rollouts_per_s": mu, "vram_gb": 16},
                          headers={"Authorization": f"Bearer {provider}"}).json()
        workers.append(Emulated(url, body["worker"]["id"], body["token"], mu, tok, stop, db))
    while admin.get(f"/v1/jobs/{job_id}").json()["version"] is None:
        time.sleep(0.2)  # the learner publishes version 0 first
    _activate(db_url, job_id, [w.worker_id for w in workers])
    for w in workers:
        w.start()
    return workers


def _activate(db_url: str, job_id: str, worker_ids: list[str]) -> None:
    """What the scheduler does once it has picked them (no Celery here: the fleet is sized by hand,
    by the capacity rule, so the solver has nothing left to choose)."""
    from api.db import Database
    from api.models import Job, Worker
    from api.services.fleet import assign
    from api.settings import get_settings

    db = Database(db_url)
    with db.session() as s:
        job = s.get_one(Job, job_id)
        for worker_id in worker_ids:
            assign(s, s.get_one(Worker, worker_id), job, get_settings())
        s.commit()
    db.dispose()


def _live_figures(metrics: list[dict[str, Any]], report: dict[str, Any]) -> dict[str, float]:
    from datetime import datetime

    stamps = [datetime.fromisoformat(m["created_at"]).timestamp() for m in metrics]
    busy = sum(m["t_train_s"] for m in metrics[1:])
    span = stamps[-1] - stamps[0]
    t_train = busy / max(1, len(metrics) - 1)
    return {"steps": len(metrics), "t_train_s": t_train, "wall_per_step_s": span / max(1, len(metrics) - 1),
            "utilisation": busy / span if span > 0 else 0.0, "stale": report["stale_fraction"] or 0.0,
            "generated": report["rollouts"]["generated"]}


def run_sim(args: argparse.Namespace, n_workers: int, t_train: float, overhead: float) -> dict[str, float]:
    from planner.sim.engine import simulate
    from planner.sim.scenario import scenario_from_dict

    scenario = scenario_from_dict({
        "name": "live-loop", "tick_s": 2.0, "lease_ttl_s": 60.0, "notice_s": 0.0, "learner_poll_s": 0.0,
        "step_overhead_s": overhead, "solver": {"method": "all"},
        "jobs": [{"id": "j", "rollouts_per_step": args.prompts, "t_train_s": t_train, "staleness": args.staleness,
                  "max_steps": args.steps, "model_gb": 0.01}],
        "worker_types": [{"name": "emulated", "count": n_workers, "price_per_h": 0.1, "vram_gb": 0,
                          "backend": "transformers", "concurrency": 1, "t_gen_s": 1.0 / args.mu,
                          "down_mbps": [10000, 10000], "up_mbps": [10000, 10000]}],
    })
    job = simulate(scenario).jobs[0]
    generated = job.prompts_consumed + job.dropped_stale
    return {"utilisation": job.steady_utilisation, "stale": job.dropped_stale / generated if generated else 0.0}


def _spec(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    return {"name": "live-loop", "base_model": str(model_dir), "task": {"name": "arithmetic"},
            "grpo": {"group_size": args.group, "prompts_per_step": args.prompts, "max_new_tokens": args.tokens},
            "staleness": args.staleness, "publish_period": 1, "max_steps": args.steps, "checkpoint_every": 100_000,
            "num_prompts": args.prompts * (args.steps + args.staleness + 2)}


def main() -> None:
    args = _parse()
    from bench.publish_overlap import build_model

    os.sched_setaffinity(0, {1})  # the emulated workers and this process stay off the learner's core
    work = Path(tempfile.mkdtemp(prefix="echo2-live-loop-"))
    model_dir = build_model(work / "model", args.layers, args.hidden)
    guess = math.ceil(1.5 * (1 + HEADROOM) * args.prompts / (args.guess_t_train * args.mu))
    calib = run_live(args, model_dir, guess, work / "calibrate")
    t_train, overhead = calib["t_train_s"], max(0.0, calib["wall_per_step_s"] - calib["t_train_s"])
    print(f"calibration: {guess} workers, T_train {t_train:.3f} s, overhead {overhead:.3f} s/step, "
          f"utilisation {calib['utilisation']:.1%}")
    print(f"{'level':>5} {'workers':>7} {'util live':>9} {'util sim':>8} {'Δ pts':>6} "
          f"{'stale live':>10} {'stale sim':>9} {'groups':>7}")
    for level in args.levels:
        n = max(1, math.ceil(level * (1 + HEADROOM) * args.prompts / (t_train * args.mu)))
        live = run_live(args, model_dir, n, work / f"level-{level}")
        sim = run_sim(args, n, live["t_train_s"], overhead)
        print(f"{level:>5.2f} {n:>7} {live['utilisation']:>9.1%} {sim['utilisation']:>8.1%} "
              f"{100 * (live['utilisation'] - sim['utilisation']):>+6.1f} {live['stale']:>10.2%} "
              f"{sim['stale']:>9.2%} {live['generated']:>7}", flush=True)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", type=float, nargs="+", default=[1.0, 0.5])
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts", type=int, default=16, help="R, groups per step")
    p.add_argument("--group", type=int, default=8, help="G, samples per group")
    p.add_argument("--tokens", type=int, default=16, help="completion tokens per sample")
    p.add_argument("--mu", type=float, default=4.0, help="each emulated worker's groups per second")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--guess-t-train", type=float, default=0.5, help="seconds; sizes the calibration fleet")
    p.add_argument("--timeout", type=float, default=900)
    return p.parse_args()


if __name__ == "__main__":
    main()
