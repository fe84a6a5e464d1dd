"""Two jobs at once on one fleet, as real process trees: a learner host with two slots runs both learners
concurrently, the scheduler shares three local workers between them, one job pauses when its budget
runs out and completes after it is raised, and the ledger accounts for every cent of both."""

import math
import time

import pytest
from echo2 import Client
from sqlalchemy import func, select

from api.db import Database
from api.models import Job, LedgerEntry, Provider, StepMetric, Worker
from api.settings import Settings
from server.demo import demo_spec
from server.local import free_port
from server.stack import Stack

pytestmark = pytest.mark.e2e
STEPS = 24


def spec(name: str, **overrides) -> dict:
    base = demo_spec("tiny", STEPS, 2)
    base["grpo"]["prompts_per_step"] = 16
    return {**base, "name": name, "eval": {"size": 0}, **overrides}


def wait_until(predicate, stack: Stack, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        stack.supervise()
        time.sleep(0.5)


def test_two_jobs_share_the_fleet_one_pauses_on_its_budget_and_the_ledger_adds_up(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_LOG_LEVEL", "WARNING")
    settings = Settings(data_dir=tmp_path / ".echo2", port=free_port())
    stack = Stack(settings, workers=3, learner_slots=2).start()
    db = Database(settings.database_url)
    try:
        with Client(base_url=stack.url, api_key=stack.admin_key) as client:
            # Three times as long as the second: still training while the second's learner starts (a tiny
            # job of STEPS steps alone can finish within the second's start-up).
            first = client.jobs.create(spec("first", max_steps=3 * STEPS))
            # A learner at $2/h spends $0.004 in about 7 s: this job pauses part-way through.
            second = client.jobs.create(spec("second", budget_usd=0.004))
            wait_until(lambda: client.jobs.get(second.id).status.value == "paused", stack)
            paused = client.jobs.get(second.id)
            assert paused.paused_for == "budget" and "raise budget_usd" in paused.status_reason
            assert paused.step < STEPS, paused
            time.sleep(5)  # its learner stopped: no step is committed while it is paused
            assert client.jobs.get(second.id).step <= paused.step + 1
            client.jobs.update(second.id, budget_usd=5.0)
            wait_until(lambda: all(client.jobs.get(j).status.is_terminal() for j in (first.id, second.id)), stack)
            final = {j: client.jobs.get(j) for j in (first.id, second.id)}
    finally:
        stack.stop()
    assert all(job.status.value == "succeeded" and job.step == job.spec.max_steps for job in final.values()), final
    with db.session() as s:
        assert s.get(Job, second.id).learner_launches >= 2  # a new learner resumed it
        windows = dict(s.execute(select(StepMetric.job_id, func.min(StepMetric.created_at))
                                 .group_by(StepMetric.job_id)).all())
        ends = dict(s.execute(select(StepMetric.job_id, func.max(StepMetric.created_at))
                              .group_by(StepMetric.job_id)).all())
        assert max(windows.values()) < min(ends.values()), "the two learners never trained at the same time"
        for job_id, job in final.items():
            entries = s.scalar(select(func.sum(LedgerEntry.amount_usd)).where(LedgerEntry.job_id == job_id))
            assert math.isclose(entries, job.cost.total_usd, rel_tol=1e-9), (entries, job.cost)
            assert s.scalar(select(func.count()).select_from(LedgerEntry).where(
                LedgerEntry.job_id == job_id, LedgerEntry.kind == "worker")) > 0, "no worker was paid for it"
        fleet = s.scalar(select(func.sum(LedgerEntry.amount_usd)).where(LedgerEntry.kind == "worker"))
        assert math.isclose(fleet, sum(j.cost.workers_usd for j in final.values()), rel_tol=1e-9)
        assert math.isclose(fleet, s.scalar(select(func.sum(Provider.earnings_usd))), rel_tol=1e-9)
        assert math.isclose(fleet, s.scalar(select(func.sum(Worker.earned_usd))), rel_tol=1e-9)
