"""Learner hosts and their slots: how many learners the platform can run at once.

A learner host (`echo2-server learner-host --slots N`, a Celery worker on the queue `learner` with
concurrency N) registers itself and then re-registers every `BEAT_S` seconds from a thread beside the
Celery worker. The reconcile tick adds up the slots of the hosts seen in the last
`learner_dead_after_s` and launches a learner only into a free slot: a job beyond them stays `queued`
with its place in line, instead of waiting inside the broker while the tick, seeing no learner start,
relaunches it with a new token every `learner_start_timeout_s`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.db import Database
from api.models import LearnerHost, utcnow

log = logging.getLogger(__name__)
BEAT_S = 5.0


def default_slots() -> int:
    """One learner a GPU; without CUDA, one a pair of CPU cores (a learner uses a few threads)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:
        pass
    return max(1, (os.cpu_count() or 2) // 2)


def host_name() -> str:
    return f"learner-host@{socket.gethostname()}:{os.getpid()}"


def register(db: Session, name: str, slots: int, now: datetime | None = None) -> None:
    host = db.get(LearnerHost, name)
    if host is None:
        db.add(LearnerHost(name=name, slots=slots, seen_at=now or utcnow()))
    else:
        host.slots, host.seen_at = slots, now or utcnow()


def unregister(db: Session, name: str) -> None:
    host = db.get(LearnerHost, name)
    if host is not None:
        db.delete(host)


def live_slots(db: Session, now: datetime, dead_after_s: float) -> int:
    """Learner slots on the hosts that registered lately."""
    seen = now - timedelta(seconds=dead_after_s)
    return int(db.scalar(select(func.coalesce(func.sum(LearnerHost.slots), 0)).where(LearnerHost.seen_at >= seen)))


def keep_registered(database: Database, name: str, slots: int, stop: threading.Event) -> threading.Thread:
    """Register now and every BEAT_S seconds until `stop` is set (a daemon thread)."""

    def beat() -> None:
        while True:
            try:
                with database.session() as db:
                    register(db, name, slots)
                    db.commit()
            except Exception as exc:  # the database may be restarting; the next beat may get through
                log.warning("learner host %s could not register: %s", name, exc)
            if stop.wait(BEAT_S):
                return

    thread = threading.Thread(target=beat, name="learner-host-registration", daemon=True)
    thread.start()
    return thread
