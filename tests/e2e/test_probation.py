"""A job whose only worker stays on probation: every group it sends is audited, and at most UNJUDGED of them
may wait for their verdict. With S > 0 the learner claims ahead for a later step; the groups it holds for
that step must be judged while the step before still waits for that worker, or neither step ever fills
(the newcomer of test_resilience met this)."""

import time

import pytest
from echo2 import Client
from sqlalchemy import func, select

from api.db import Database
from api.models import Audit, Worker
from api.services.pool import UNJUDGED
from api.settings import Settings
from server.demo import demo_spec
from server.local import free_port
from server.stack import Stack

pytestmark = pytest.mark.e2e
STEPS = 6


def test_a_lone_worker_on_probation_carries_a_stale_tolerant_job_to_its_end(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("ECHO2_PROBATION_AUDITS", "1000")  # it never leaves probation in this job
    settings = Settings(data_dir=tmp_path / ".echo2", port=free_port())
    stack = Stack(settings, workers=1).start()
    spec = demo_spec("tiny", STEPS, 2)
    spec["grpo"]["prompts_per_step"] = 2 * UNJUDGED  # a step takes two rounds of its unjudged groups
    try:
        with Client(base_url=stack.url, api_key=stack.admin_key) as client:
            job = client.jobs.create(spec)
            deadline = time.monotonic() + 420
            while not (final := client.jobs.get(job.id)).status.is_terminal():
                assert time.monotonic() < deadline, f"stuck at step {final.step}: {final.status_reason}"
                stack.supervise()
                time.sleep(0.5)
    finally:
        stack.stop()
    assert final.status.value == "succeeded" and final.step == STEPS, final
    with Database(settings.database_url).session() as s:
        worker = s.scalars(select(Worker)).one()
        assert worker.trust.value == "probation"
        assert s.scalar(select(func.count()).select_from(Audit).where(Audit.job_id == job.id)) >= STEPS * 2 * UNJUDGED
