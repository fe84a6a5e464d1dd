"""Version notices: a long-poll for the next version answers as soon as the learner publishes one."""

from __future__ import annotations

import threading
import time

from tests.factories import activate, fake_model_folder, new_provider, new_user, new_worker, ok, publish, running_job


def test_a_waiting_worker_hears_of_a_new_version_at_once(api, tmp_path):
    _, alice = new_user(api)
    folder = fake_model_folder(tmp_path / "m")
    job, learner = running_job(api, alice, folder)
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    got: dict = {}

    def wait() -> None:
        got["notice"] = ok(worker.get(f"/v1/jobs/{job['id']}/versions/next", params={"after": 0, "timeout_s": 30}))
        got["at"] = time.monotonic()

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive()  # nothing newer yet: it waits
    publish(learner, job["id"], folder, version=1, step=1)
    published = time.monotonic()
    waiter.join(timeout=30)
    assert got["notice"] == {"job_id": job["id"], "version": 1, "job_status": "running", "changed": True}
    assert got["at"] - published < 1.0  # woken by the publish, not by a recheck or the timeout


def test_a_wait_times_out_unchanged_and_answers_at_once_when_behind(api, tmp_path):
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    start = time.monotonic()
    idle = ok(alice.get(f"/v1/jobs/{job['id']}/versions/next", params={"after": 0, "timeout_s": 0.5}))
    assert idle["changed"] is False and idle["version"] == 0 and time.monotonic() - start >= 0.5
    behind = ok(alice.get(f"/v1/jobs/{job['id']}/versions/next", params={"after": -1}))
    assert behind["changed"] is True and behind["version"] == 0
    ok(alice.post(f"/v1/jobs/{job['id']}/cancel"))
    ended = ok(alice.get(f"/v1/jobs/{job['id']}/versions/next", params={"after": 0, "timeout_s": 5}))
    assert ended["changed"] is True and ended["job_status"] == "cancelled"


def test_only_those_who_may_read_the_job_may_wait_on_it(api, tmp_path):
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    _, bob = new_user(api, "bob")
    assert bob.get(f"/v1/jobs/{job['id']}/versions/next", params={"after": 0}).status_code == 404
    assert api.client("nope").get(f"/v1/jobs/{job['id']}/versions/next", params={"after": 0}).status_code == 401
    assert api.client().get(f"/v1/jobs/{job['id']}/versions/next", params={"after": 0}).status_code == 401
