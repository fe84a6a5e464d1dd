"""Kill -9 the learner process mid-run and start it again: it resumes from its checkpoint, versions
stay monotonic, and no rollout is trained twice."""

import os
import signal
import subprocess
import sys
import time

import pytest

from api.demo import demo_spec
from tests.factories import activate, learner_for, new_provider, new_user, new_worker, ok
from tests.rollout_driver import RolloutDriver

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)]


def start_learner(api, job_id, token, work_dir, log):
    """The learner CLI in its own process; its output goes to `log` (a pipe nobody reads would fill)."""
    env = {**os.environ, "ECHO2_LEARNER_TOKEN": token, "ECHO2_LOG_LEVEL": "INFO"}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "api.cli", "learner", "--job", job_id, "--server", api.url,
                                 "--work-dir", str(work_dir)], env=env, stdout=out, stderr=subprocess.STDOUT)


def trained(alice, jid):
    items, offset = [], 0
    while offset is not None:
        page = ok(alice.get(f"/v1/jobs/{jid}/rollouts", params={"status": "trained", "limit": 200, "offset": offset}))
        items += page["items"]
        offset = page["next_offset"]
    return items


def wait_for(predicate, timeout=300):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def test_kill_and_resume(api, tmp_path):
    _, alice = new_user(api)
    spec = {**demo_spec("tiny", 12, 1), "checkpoint_every": 3}
    job = ok(alice.post("/v1/jobs", json=spec), 201)
    jid = job["id"]
    token = learner_for(api, jid).headers["Authorization"].split()[1]
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, jid)
    driver = RolloutDriver(api.url, wid, worker.headers["Authorization"].split()[1], tmp_path / "w").start()
    learners: list[subprocess.Popen] = []
    try:
        learners.append(start_learner(api, jid, token, tmp_path / "learner", tmp_path / "first.log"))
        wait_for(lambda: ok(alice.get(f"/v1/jobs/{jid}"))["step"] >= 5)
        learners[0].send_signal(signal.SIGKILL)
        learners[0].wait(timeout=30)
        step_at_kill = ok(alice.get(f"/v1/jobs/{jid}"))["step"]
        before = {r["id"] for r in trained(alice, jid)}
        # The kill may land while ckpt-N.tmp is being written; `latest` names the newest complete one.
        latest = (tmp_path / "learner" / jid / "checkpoints" / "latest").read_text()
        assert latest in {f"ckpt-{s}" for s in range(3, step_at_kill + 1, 3)}

        learners.append(start_learner(api, jid, token, tmp_path / "learner", tmp_path / "second.log"))
        learners[1].wait(timeout=600)
    finally:
        for proc in learners:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        driver.stop()
    out = (tmp_path / "second.log").read_text()
    assert learners[1].returncode == 0, out[-3000:]
    assert f"resumed from checkpoint at step {latest.split('-')[1]}" in out
    final = ok(alice.get(f"/v1/jobs/{jid}"))
    assert final["status"] == "succeeded" and final["step"] == 12
    versions = [v["version"] for v in ok(alice.get(f"/v1/jobs/{jid}/versions"))]
    assert versions == sorted(set(versions)) and versions[-1] == 12
    rows = trained(alice, jid)
    assert len(rows) == len({r["id"] for r in rows}) == 12 * spec["grpo"]["prompts_per_step"]
    after = {r["id"] for r in rows} - before
    assert after and not (after & before)
    assert sorted({r["trained_step"] for r in rows}) == list(range(12))
    assert all(r["trained_step"] >= step_at_kill for r in rows if r["id"] in after)
