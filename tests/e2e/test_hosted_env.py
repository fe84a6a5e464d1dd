"""A multi-turn job whose environment the user hosts over HTTP, end to end as real process trees: the
workers play its episodes through the control plane, the learner trains on the environment's rewards,
and an environment that fails or hangs on some prompts costs those groups only: the job completes."""

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from echo2 import Client
from sqlalchemy import select

from api.db import Database
from api.models import Rollout
from api.settings import Settings
from server.local import free_port
from server.stack import Stack

pytestmark = pytest.mark.e2e
STEPS = 3


class Environment(BaseHTTPRequestHandler):
    """Say the reference in at most 2 turns. The reference "503" answers 503; "hang" outlasts the timeout."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["reference"] == "hang":
            time.sleep(2)
        if body["reference"] == "503":
            return self._send(503, {})
        said = body["actions"][-1].strip()
        if said == body["reference"] or len(body["actions"]) == 2:
            return self._send(200, {"done": True, "reward": float(said == body["reference"])})
        self._send(200, {"done": False, "observation": f"not {said[:8]}."})

    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError):  # the hanging case: the control plane stopped waiting
            self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_a_job_with_a_user_hosted_environment_completes_despite_a_failing_one(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_LOG_LEVEL", "WARNING")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Environment)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    items = [{"prompt": "say 7.", "reference": "7"}] * 40 + [{"prompt": "say 8.", "reference": "503"}] * 4 + \
        [{"prompt": "say 9.", "reference": "hang"}] * 4
    task = {"name": "http_env", "params": {"url": f"http://127.0.0.1:{server.server_port}/", "max_turns": 2,
                                           "timeout_s": 0.5, "max_retries": 1, "backoff_s": 0.0}}
    settings = Settings(data_dir=tmp_path / ".echo2", port=free_port())
    stack = Stack(settings, workers=2).start()
    try:
        with Client(base_url=stack.url, api_key=stack.admin_key) as client:
            job = client.jobs.create({"name": "hosted", "base_model": "echo2:tiny", "task": task, "max_steps": STEPS,
                                      "staleness": 1, "prompts": [{"item": i} for i in items],
                                      "grpo": {"group_size": 4, "prompts_per_step": 8, "max_new_tokens": 3}})
            deadline = time.monotonic() + 300
            while not (final := client.jobs.get(job.id)).status.is_terminal():
                assert time.monotonic() < deadline, "timed out"
                stack.supervise()
                time.sleep(0.5)
    finally:
        stack.stop()
        server.shutdown()
    assert final.status.value == "succeeded" and final.step == STEPS, final.status_reason
    with Database(settings.database_url).session() as s:
        rows = list(s.scalars(select(Rollout).where(Rollout.job_id == job.id)))
    trained = [r for r in rows if r.status == "trained"]
    assert {r.trained_step for r in trained} == set(range(STEPS))
    assert all(len(x["turns"]) in (1, 3) for r in trained for x in r.samples)  # 1 or 2 model turns
    assert all(r.rewards is not None and set(r.rewards) <= {0.0, 1.0} for r in trained)
    failed = [r for r in rows if r.reject_kind == "environment_failed"]
    assert failed, "no prompt with a failing environment was played"
    for r in failed:  # the environment's fault, said plainly; never trained
        assert "the environment failed at turn 0" in r.reason and ("HTTP 503" in r.reason or "Timeout" in r.reason)
