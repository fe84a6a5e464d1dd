"""Audits in the learner's spare time, off and on, on the demo job with a trusted cheater in the fleet.

    python bench/spare_audits.py                    # 2 rounds of off, on; 30 steps each
    python bench/spare_audits.py --rounds 3 --max-steps 40 --cheat pick

Per run: the real control plane as a subprocess (SQLite, as bench/learner_staleness.py starts it), the demo job
(tiny model, arithmetic, G = 8, 64 prompts a step, S = 2), the real learner in a thread of this process, two
honest rollout workers (tests/rollout_driver.py) and one cheater (tests/cheaters.py, `--cheat`, default `stale`:
samples with the first version it loaded, claims the newest, logprobs recomputed honestly) that is trusted from
its first group, as one that passed its probation honestly and then started cheating would be. "off" sets
learner.loop.SPARE_AUDIT_S to 0 (only the groups the control plane picks are audited: one in each window of 10 of
a trusted worker); "on" keeps it. Reported: the cheater's accepted groups and its state when the job ends (once
quarantined it gets no more work, so its accepted groups are what it sent before), how many of them were trained,
audited and failed, the step of its last audit (about when it was quarantined), the share of the honest
workers' accepted groups that were audited, and the learner's audit seconds, busy seconds (in its steps), wall
seconds and utilisation. Everything shares the machine's cores: compare off and on of the same round.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learner_staleness import ADMIN_KEY, REPO, activate, bench_spec, control_plane, ok  # noqa: E402

sys.path.insert(0, str(REPO))


@dataclass
class Run:
    side: str
    steps: int
    cheater_groups: int
    cheater_state: str
    cheater_failed: int
    cheater_audited: int
    cheater_trained: int
    last_audit_step: int
    honest_groups: int
    honest_audited: int
    audit_s: float
    busy_s: float
    wall_s: float


def trust(db_url: str, worker_id: str) -> None:
    """Trusted from its first group: its probation passed (the state a worker that turns to cheating is in)."""
    from echo2.protocol import TrustState

    from api.db import Database
    from api.models import Worker

    db = Database(db_url)
    with db.session() as s:
        worker = s.get(Worker, worker_id)
        worker.trust, worker.audits_passed = TrustState.trusted, 5
        s.commit()
    db.engine.dispose()


def counts(db_url: str, cheater: str, honest: list[str]) -> dict[str, Any]:
    from echo2.protocol import RolloutStatus
    from sqlalchemy import func, select

    from api.db import Database
    from api.models import Audit, Rollout, Worker

    db = Database(db_url)
    with db.session() as s:
        c = s.get(Worker, cheater)
        audited = s.scalar(select(func.count()).select_from(Audit).where(Audit.worker_id.in_(honest)))
        groups = s.scalar(select(func.count()).select_from(Rollout).where(Rollout.worker_id.in_(honest),
                                                                         Rollout.seq.is_not(None)))
        theirs = list(s.scalars(select(Audit).where(Audit.worker_id == cheater)))
        trained = s.scalar(select(func.count()).select_from(Rollout).where(Rollout.worker_id == cheater,
                                                                          Rollout.status == RolloutStatus.trained))
        out = {"cheater_groups": c.groups_numbered, "cheater_state": c.trust.value, "cheater_failed": c.audits_failed,
               "cheater_audited": len(theirs), "cheater_trained": trained,
               "last_audit_step": max((a.step for a in theirs), default=-1),
               "honest_groups": groups, "honest_audited": audited}
    db.engine.dispose()
    return out


def run_one(base_url: str, db_url: str, work: Path, side: str, cheat: str, max_steps: int, spare_s: float) -> Run:
    import httpx

    import learner.loop as loop
    from learner.loop import Learner, LearnerOptions
    from learner.remote import ControlPlane
    from tests.cheaters import Cheater
    from tests.rollout_driver import RolloutDriver

    loop.SPARE_AUDIT_S = 0.0 if side == "off" else spare_s
    admin = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
    user_key = ok(admin.post("/v1/users", json={"name": f"bench-{side}", "role": "user"}), 201)["api_key"]
    user = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {user_key}"}, timeout=60)
    job_id = ok(user.post("/v1/jobs", json=bench_spec(2, max_steps)), 201)["id"]
    plane = ControlPlane(base_url, ok(admin.post(f"/v1/jobs/{job_id}/learner/token"), 201)["token"], job_id)
    learner = Learner(plane, LearnerOptions(work_dir=work / "learner", heartbeat_s=1.0, threads=1))
    thread = threading.Thread(target=learner.run, name="learner", daemon=True)
    thread.start()
    workers: dict[str, Any] = {}
    for name in ("honest-0", "honest-1", cheat):  # a provider each: a quarantine puts only its own on watch
        provider = ok(admin.post("/v1/providers", json={"name": name}), 201)["token"]
        body = ok(httpx.post(f"{base_url}/v1/workers", json={"name": name},
                             headers={"Authorization": f"Bearer {provider}"}, timeout=60), 201)
        wid = body["worker"]["id"]
        activate(db_url, wid, job_id)
        if name == cheat:
            trust(db_url, wid)
            workers[wid] = Cheater(cheat, base_url, wid, body["token"], work / name).start()
        else:
            workers[wid] = RolloutDriver(base_url, wid, body["token"], work / name).start()
    started = time.monotonic()
    while thread.is_alive() and time.monotonic() - started < 900:
        time.sleep(0.5)
    wall = time.monotonic() - learner.started
    for driver in workers.values():
        driver.stop()
    plane.close()
    metrics = ok(user.get(f"/v1/jobs/{job_id}/metrics"))
    ids = list(workers)
    found = counts(db_url, ids[2], ids[:2])
    for c in (admin, user):
        c.close()
    return Run(side=side, steps=len(metrics), audit_s=sum(m["audit_s"] for m in metrics), busy_s=learner.busy_s,
               wall_s=wall, **found)


def row(r: Run) -> str:
    return (f"{r.side:4} {r.steps:5d} {r.cheater_groups:9d} {r.cheater_trained:7d} {r.cheater_audited:7d} "
            f"{r.cheater_failed:6d} {r.last_audit_step:9d}  {r.cheater_state:12} "
            f"{r.honest_audited:6d} / {r.honest_groups:<6d} {100 * r.honest_audited / max(1, r.honest_groups):6.1f} % "
            f"{r.audit_s:8.1f} {r.busy_s:7.1f} {r.wall_s:7.1f} {r.busy_s / r.wall_s:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--cheat", default="stale", choices=("stale", "stale3", "nearby", "copy", "eos", "pick"))
    args = parser.parse_args()
    import learner.loop as loop

    spare_s = loop.SPARE_AUDIT_S
    print(f"spare_audits: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, cheat {args.cheat}, "
          f"{args.max_steps} steps a run, SPARE_AUDIT_S {spare_s} when on; load average {os.getloadavg()[0]:.2f}")
    print("side steps  cheater: groups trained audited failed last step  state        honest: audited / groups"
          "        audit s  busy s  wall s  util")
    for _ in range(args.rounds):
        for side in ("off", "on"):
            with tempfile.TemporaryDirectory(prefix="echo2-spare-") as tmp:
                work = Path(tmp)
                with control_plane(work) as url:
                    print(row(run_one(url, f"sqlite:///{work / 'echo2.db'}", work, side, args.cheat,
                                      args.max_steps, spare_s)), flush=True)


if __name__ == "__main__":
    main()
