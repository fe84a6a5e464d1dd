"""A job whose reward endpoint (task http_reward) goes down mid-job, end to end as real process trees: no group
is trained on a missing reward, the job pauses saying why (status_reason, `echo2 jobs watch`), the workers
whose groups were lost to it are paid (the platform's fault), and once the endpoint is back `echo2 jobs
resume` picks the job up where it stopped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from echo2 import Client
from sqlalchemy import select

from api.db import Database
from api.models import Rollout, StepMetric
from api.settings import Settings
from server.local import free_port
from server.stack import Stack

pytestmark = pytest.mark.e2e
STEPS, PAUSE_AFTER = 6, 4


class Verifier(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        data = json.dumps({"reward": float(body["reference"] in body["completion"])}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def serve(port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), Verifier)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def wait(what: str, timeout: float, stack: Stack, predicate):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        stack.supervise()
        time.sleep(0.5)
    return value


def test_a_reward_endpoint_taken_down_pauses_the_job_and_resume_finishes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_LOG_LEVEL", "WARNING")
    port = free_port()
    endpoint = serve(port)
    items = [{"prompt": f"say {i}.", "reference": str(i)} for i in range(40)]
    task = {"name": "http_reward", "params": {"url": f"http://127.0.0.1:{port}/", "timeout_s": 0.5,
                                              "max_retries": 0, "backoff_s": 0.0}}
    settings = Settings(data_dir=tmp_path / ".echo2", port=free_port())
    stack = Stack(settings, workers=2).start()
    cli_env = {**os.environ, "ECHO2_BASE_URL": stack.url, "ECHO2_API_KEY": stack.admin_key}
    try:
        with Client(base_url=stack.url, api_key=stack.admin_key) as client:
            job = client.jobs.create({"name": "reward-down", "base_model": "echo2:tiny", "task": task,
                                      "max_steps": STEPS, "staleness": 1, "checkpoint_every": 1,
                                      "reward_failures_to_pause": PAUSE_AFTER, "eval": {"size": 0},
                                      "prompts": [{"item": i} for i in items],
                                      "grpo": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 3}})
            wait("two trained steps", 300, stack, lambda: client.jobs.get(job.id).step >= 2)
            endpoint.shutdown()
            endpoint.server_close()  # down: every call is refused
            paused = wait("the pause", 300, stack,
                          lambda: (j := client.jobs.get(job.id)).status.value == "paused" and j)
            watched = subprocess.run([sys.executable, "-m", "echo2.cli", "jobs", "watch", job.id, "--timeout", "3"],
                                     capture_output=True, text=True, env=cli_env, timeout=60)
            with Database(settings.database_url).session() as s:
                failed = wait("the lost groups paid", 60, stack, lambda: [
                    r for r in s.scalars(select(Rollout).where(Rollout.job_id == job.id,
                                                               Rollout.reject_kind == "reward_failed"))
                    if r.paid_entry_id is not None] or s.rollback())
            endpoint = serve(port)  # back up
            resumed = subprocess.run([sys.executable, "-m", "echo2.cli", "jobs", "resume", job.id],
                                     capture_output=True, text=True, env=cli_env, timeout=60)
            final = wait("the job to finish", 300, stack,
                         lambda: (j := client.jobs.get(job.id)).status.is_terminal() and j)
    finally:
        stack.stop()
        endpoint.shutdown()
        endpoint.server_close()

    assert paused.paused_for == "reward"
    reason = paused.status_reason
    # A step reports all its unscored groups at once, so the run that pauses the job may pass the threshold.
    in_a_row = re.search(r"(\d+) groups in a row could not be scored by task http_reward", reason)
    assert in_a_row and int(in_a_row[1]) >= PAUSE_AFTER, reason
    assert "ConnectError" in reason and f"echo2 jobs resume {job.id}" in reason, reason
    # the steps that trained nothing count toward max_steps: the reason says so (a user found it out from the report)
    assert re.search(rf"steps? [\d-]+ trained no group but counts? among its {STEPS} steps", reason), reason
    assert f"job {job.id} paused: {reason}" in watched.stdout, watched.stdout + watched.stderr
    assert resumed.returncode == 0 and "queued" in resumed.stdout, resumed.stdout + resumed.stderr
    assert failed and all("the task could not score it" in r.reason for r in failed)

    assert final.status.value == "succeeded" and final.step == STEPS, final.status_reason
    with Database(settings.database_url).session() as s:
        rows = list(s.scalars(select(Rollout).where(Rollout.job_id == job.id)))
        steps = sorted(s.scalars(select(StepMetric.step).where(StepMetric.job_id == job.id)))
        unscored = sum(s.scalars(select(StepMetric.groups_unscored).where(StepMetric.job_id == job.id)))
    trained = [r for r in rows if r.status == "trained"]
    assert steps == list(range(STEPS))  # every step once: the resumed learner went on where it stopped
    assert trained and all(r.rewards is not None and None not in r.rewards for r in trained)
    lost = [r for r in rows if r.reject_kind == "reward_failed"]
    assert len(lost) == unscored >= int(in_a_row[1]) and all(r.trained_step is None for r in lost)
