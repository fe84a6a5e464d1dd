"""Kill -9 the learner process between checkpoints and start it again on a host with an empty work
directory: it fetches its checkpoint from the control plane and replays the steps committed since, bit
for bit, so the step history has no gap and nothing trained twice or lost, and versions stay monotonic
with nothing orphaned."""

import os
import signal
import subprocess
import sys
import time

import pytest

from server.demo import demo_spec
from tests.factories import activate, learner_for, new_provider, new_user, new_worker, ok
from tests.rollout_driver import RolloutDriver

pytestmark = [pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)]


def start_learner(api, job_id, token, work_dir, log):
    """The learner CLI in its own process; its output goes to `log` (a pipe nobody reads would fill)."""
    env = {**os.environ, "ECHO2_LEARNER_TOKEN": token, "ECHO2_LOG_LEVEL": "INFO"}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "server.cli", "learner", "--job", job_id, "--server", api.url,
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


def test_kill_between_checkpoints_and_resume_elsewhere(api, tmp_path):
    _, alice = new_user(api)
    spec = {**demo_spec("tiny", 14, 1), "checkpoint_every": 5}
    job = ok(alice.post("/v1/jobs", json=spec), 201)
    jid = job["id"]
    token = learner_for(api, jid).headers["Authorization"].split()[1]
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, jid)
    driver = RolloutDriver(api.url, wid, worker.headers["Authorization"].split()[1], tmp_path / "w").start()
    learners: list[subprocess.Popen] = []
    try:
        learners.append(start_learner(api, jid, token, tmp_path / "host-a", tmp_path / "first.log"))
        wait_for(lambda: ok(alice.get(f"/v1/jobs/{jid}"))["step"] >= 6)
        learners[0].send_signal(signal.SIGKILL)
        learners[0].wait(timeout=30)
        at_kill = ok(alice.get(f"/v1/jobs/{jid}"))
        versions_before = [v["version"] for v in ok(alice.get(f"/v1/jobs/{jid}/versions"))]
        before = {r["id"] for r in trained(alice, jid)}
        checkpointed = 5 * (at_kill["step"] // 5)  # the newest checkpoint stored before the kill
        learners.append(start_learner(api, jid, token, tmp_path / "host-b", tmp_path / "second.log"))
        learners[1].wait(timeout=600)
    finally:
        for proc in learners:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        driver.stop()
    out = (tmp_path / "second.log").read_text()
    assert learners[1].returncode == 0, out[-3000:]
    assert f"fetched the checkpoint of step {checkpointed} from the control plane" in out, out[-3000:]
    if at_kill["step"] > checkpointed:  # the steps after the checkpoint are trained again, to the same weights
        assert f"replayed steps {checkpointed}..{at_kill['step'] - 1} committed after the checkpoint" in out
        if at_kill["version"] > checkpointed:
            assert "(bit-exact with the published version)" in out, out[-3000:]
    final = ok(alice.get(f"/v1/jobs/{jid}"))
    assert final["status"] == "succeeded" and final["step"] == 14
    versions = [v["version"] for v in ok(alice.get(f"/v1/jobs/{jid}/versions"))]
    assert versions == sorted(set(versions)) and versions[-1] == 14
    assert versions[: len(versions_before)] == versions_before  # nothing the workers held was replaced
    rows = trained(alice, jid)
    assert len(rows) == len({r["id"] for r in rows}) == 14 * spec["grpo"]["prompts_per_step"]
    after = {r["id"] for r in rows} - before
    assert after and not (after & before)
    assert sorted({r["trained_step"] for r in rows}) == list(range(14))
    assert all(r["trained_step"] >= at_kill["step"] for r in rows if r["id"] in after)
