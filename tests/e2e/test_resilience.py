"""Churn and infrastructure failures during a real run: kill -9 the Celery scheduler mid-run, restart
Redis, kill -9 all three workers as a newcomer joins, then kill -9 the learner host in the middle of its
learner task. The database is the source of truth, so the job still completes and no prompt is lost."""

import os
import signal
import time

import pytest
from echo2 import Client
from sqlalchemy import select

from api.db import Database
from api.models import Decision, Job, Lease, Prompt, Rollout, Worker
from api.settings import Settings
from server.demo import demo_spec
from server.local import free_port
from server.stack import Stack

pytestmark = pytest.mark.e2e
STEPS = 40
VICTIMS = ("worker-0", "worker-1", "worker-2")


def wait_until(predicate, stack, timeout=600):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        stack.supervise()  # what a process manager does: restart what crashed
        time.sleep(0.5)


def accepted_by(db: Database, name: str) -> int:
    with db.session() as s:
        return s.scalar(select(Worker.accepted_rollouts).where(Worker.name == name)) or 0


def _newcomer_worked(client: Client, job_id: str, db: Database) -> bool:
    job = client.jobs.get(job_id)
    assert not job.status.is_terminal(), f"the job ended ({job.status.value}) before the newcomer's rollouts"
    return job.step >= 12 and accepted_by(db, "local-3") > 0


def test_job_survives_scheduler_kill_redis_restart_and_worker_churn(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_LEASE_TTL_S", "8")
    monkeypatch.setenv("ECHO2_WORKER_OFFLINE_AFTER_S", "5")
    monkeypatch.setenv("ECHO2_LEARNER_DEAD_AFTER_S", "6")
    monkeypatch.setenv("ECHO2_LEARNER_START_TIMEOUT_S", "60")
    monkeypatch.setenv("ECHO2_LOG_LEVEL", "WARNING")
    port = free_port()
    settings = Settings(data_dir=tmp_path / ".echo2", port=port)
    stack = Stack(settings, workers=3).start()
    db = Database(settings.database_url)
    try:
        with Client(base_url=stack.url, api_key=stack.admin_key) as client:
            job = client.jobs.create(demo_spec("tiny", STEPS, 2))
            wait_until(lambda: client.jobs.get(job.id).step >= 4, stack)
            scheduler = next(c for c in stack.children if c.name == "scheduler")
            os.killpg(scheduler.proc.pid, signal.SIGKILL)
            stack.redis.stop()
            stack.redis.start()
            for victim in (c for c in stack.children if c.name in VICTIMS):
                victim.restarts = 10**6  # stays dead: churn, not a restart
                os.killpg(victim.proc.pid, signal.SIGKILL)
            # A newcomer the scheduler must put to work. Every old worker dies: whether another worker is
            # needed beside a survivor is the capacity rule's call on measured rates, and one or two survivors
            # sometimes met it on a loaded machine, so the newcomer stayed idle until the job ended.
            stack.add_worker()
            # It must join, be activated, fetch and generate before the job ends: wait for its rollouts.
            wait_until(lambda: _newcomer_worked(client, job.id, db), stack)
            host = next(c for c in stack.children if c.name == "learner-host")
            os.killpg(host.proc.pid, signal.SIGKILL)  # the learner runs inside its Celery task
            wait_until(lambda: client.jobs.get(job.id).status.is_terminal(), stack)
            final = client.jobs.get(job.id)
    finally:
        stack.stop()
    assert final.status.value == "succeeded" and final.step == STEPS, final
    with db.session() as s:
        workers = {w.name: w for w in s.scalars(select(Worker))}
        for dead in ("local-0", "local-1", "local-2"):
            assert workers[dead].status == "offline" and workers[dead].job_id is None
            assert not list(s.scalars(select(Lease).where(Lease.worker_id == workers[dead].id,
                                                          Lease.status == "active")))
        assert workers["local-3"].accepted_rollouts > 0, "the replacement was never activated"
        assert s.scalars(select(Decision).where(Decision.worker_id == workers["local-3"].id,
                                                Decision.action == "activated")).first() is not None
        prompts = list(s.scalars(select(Prompt).where(Prompt.job_id == job.id, Prompt.state != "eval")))
        active = {lease.id for lease in s.scalars(select(Lease).where(Lease.status == "active"))}
        queued = {r.prompt_id for r in s.scalars(select(Rollout).where(Rollout.status.in_(("accepted", "claimed"))))}
        for p in prompts:  # every prompt is somewhere it can still be trained from
            assert p.state in ("available", "leased", "submitted", "trained"), p.state
            if p.state == "leased":
                assert p.lease_id in active or p.lease_id is None
            if p.state == "submitted":
                assert p.id in queued
        steps = {r.trained_step for r in s.scalars(select(Rollout).where(Rollout.status == "trained"))}
    assert steps == set(range(STEPS))
    with db.session() as s:
        assert s.get(Job, job.id).learner_launches >= 2, "the dead learner was not relaunched"
