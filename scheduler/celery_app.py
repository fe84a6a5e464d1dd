"""The Celery application: the reconcile tick (beat, default queue) and learner runs, each sent to the queue
of the learner host the tick placed it on (scheduler/hosts.py `queue_of`), with its slots' GPU ids.

The database is the source of truth; Redis only carries work. A tick is idempotent and guarded by a
Redis lock so ticks never overlap. A learner run is acknowledged on receipt: if its host dies, the
reconcile tick notices the silent learner and launches a new one with a new token (which fences
the old one off), and the new learner resumes from its checkpoint.
"""

from __future__ import annotations

import logging

import redis
from celery import Celery

from api.db import Database
from api.settings import Settings, get_settings

from .hosts import queue_of
from .placement import Placement

log = logging.getLogger(__name__)
DEFAULT_QUEUE = "echo2"


def create_celery(settings: Settings) -> Celery:
    if not settings.redis_url:
        raise RuntimeError("ECHO2_REDIS_URL is not set (echo2-server up starts a private Redis)")
    app = Celery("echo2", broker=settings.redis_url)
    app.conf.update(
        task_default_queue=DEFAULT_QUEUE,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        # Longer than any tick; learner runs are acked on receipt, so they never wait on this.
        broker_transport_options={"visibility_timeout": 600},
        worker_hijack_root_logger=False,
        beat_schedule={"reconcile": {"task": "echo2.reconcile", "schedule": settings.reconcile_interval_s,
                                     "options": {"expires": 4 * settings.reconcile_interval_s}}},
    )
    _register(app, settings)
    return app


def _register(app: Celery, settings: Settings) -> None:
    state: dict[str, Database] = {}

    def database() -> Database:
        if "db" not in state:  # one engine per worker process, created after the fork
            state["db"] = Database(settings.database_url)
        return state["db"]

    @app.task(name="echo2.reconcile", autoretry_for=(ConnectionError,), max_retries=3)
    def reconcile() -> None:
        from .reconcile import tick

        lock = redis.Redis.from_url(settings.redis_url).lock("echo2:reconcile", timeout=120, blocking=False)
        if not lock.acquire():
            return  # another tick is running; the next beat will come
        try:
            with database().session() as session:
                report = tick(session, settings, launch=launch)
            if report.launched or report.offline or report.activated or report.deactivated:
                log.info("tick: %s", report)
        finally:
            lock.release()

    def launch(job_id: str, token: str, placement: Placement) -> None:
        # argsrepr: what Celery's logs and events show of the task's arguments, never the token itself
        devices = placement.devices or None
        run_learner.apply_async((job_id, token, devices), queue=queue_of(placement.host),
                                argsrepr=repr((job_id, "<learner token>", devices)))

    @app.task(name="echo2.run_learner", acks_late=False)
    def run_learner(job_id: str, token: str, devices: list[str] | None = None) -> None:
        """On the GPUs `devices` of this host when given, in a child process that sees only those; else in
        this process, or as a torchrun group when the job asks for several GPUs (learner.launch)."""
        from learner.launch import run_job
        from learner.loop import LearnerOptions

        options = LearnerOptions(work_dir=settings.data_dir / "learner", threads=settings.learner_threads)
        run_job(settings.public_url, token, job_id, options, devices)


def app_for_cli() -> Celery:
    return create_celery(get_settings())
