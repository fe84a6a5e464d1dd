"""Learner hosts and their slots: how many learners the platform can run at once, and on which GPUs.

A learner host (`echo2-server learner-host`, a Celery worker on its own queue `queue_of(name)`) registers
itself with its slots and its GPUs, and then re-registers every `BEAT_S` seconds from a thread beside the
Celery worker. On a host with GPUs a slot is a GPU: slot i is `gpus[i]`, and a learner launched into slots
i, j sees only those cards (CUDA_VISIBLE_DEVICES, learner/launch.py), so two learners never share one. A
host without GPUs offers CPU slots (one a pair of cores by default). The reconcile tick places each
learner on one live host with enough free slots (queue.py) and sends it to that host's queue: a job
beyond them stays `queued` with its place in line, instead of waiting inside the broker while the tick,
seeing no learner start, relaunches it with a new token every `learner_start_timeout_s`.

The GPUs are found by a child process (`probe_gpus`), so that the host's own process never initialises
CUDA: the Celery pool forks its workers from it, and a forked CUDA context is unusable.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.db import Database
from api.models import LearnerHost, utcnow

log = logging.getLogger(__name__)
BEAT_S = 5.0
PROBE_TIMEOUT_S = 120.0

# Run by `probe_gpus` in a child: each visible GPU, named by the id CUDA_VISIBLE_DEVICES gives it on this
# host (its index, or the entry of the host's own mask), so that a learner's mask names the same card.
_PROBE = """
import json, os
try:
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
except ImportError:
    count = 0
mask = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
out = []
for i in range(count):
    p = torch.cuda.get_device_properties(i)
    out.append({"id": mask[i] if i < len(mask) else str(i), "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 2)})
print(json.dumps(out))
"""


def probe_gpus() -> list[dict[str, Any]]:
    """This machine's GPUs as {"id", "name", "memory_gib"}; [] without CUDA (or when the probe fails)."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, check=True)
        return list(json.loads(done.stdout.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        log.warning("could not list this host's GPUs (running CPU learners): %s", exc)
        return []


def describe(slots: int | None, gpus: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """(slots, the GPU of each slot) for a host with these GPUs: a slot a GPU, the first `slots` of them
    when given (never more than it has: two learners on one card would share its memory); without GPUs,
    `slots` CPU slots (default: one a pair of cores)."""
    if slots is not None and slots < 1:
        raise ValueError(f"--slots {slots}: a learner host needs at least 1 slot")
    if not gpus:
        return slots or max(1, (os.cpu_count() or 2) // 2), []
    if slots is not None and slots > len(gpus):
        log.warning("--slots %d on a host with %d GPU(s): %d slots, a slot a GPU (hide the GPUs with "
                    "CUDA_VISIBLE_DEVICES= to run CPU learners instead)", slots, len(gpus), len(gpus))
    used = gpus[:slots] if slots is not None else gpus
    return len(used), used


def host_name() -> str:
    return f"learner-host@{socket.gethostname()}:{os.getpid()}"


def queue_of(name: str) -> str:
    """The Celery queue only this host consumes: the scheduler sends each learner to the host it placed it on."""
    return f"learner.{name}"


def register(db: Session, name: str, slots: int, now: datetime | None = None,
             gpus: list[dict[str, Any]] | None = None) -> None:
    host = db.get(LearnerHost, name)
    if host is None:
        db.add(LearnerHost(name=name, slots=slots, gpus=gpus or [], seen_at=now or utcnow()))
    else:
        host.slots, host.gpus, host.seen_at = slots, gpus or [], now or utcnow()


def unregister(db: Session, name: str) -> None:
    host = db.get(LearnerHost, name)
    if host is not None:
        db.delete(host)


def live_hosts(db: Session, now: datetime, dead_after_s: float) -> list[LearnerHost]:
    """The hosts that registered lately, by name."""
    seen = now - timedelta(seconds=dead_after_s)
    return list(db.scalars(select(LearnerHost).where(LearnerHost.seen_at >= seen).order_by(LearnerHost.name)))


def keep_registered(database: Database, name: str, slots: int, stop: threading.Event,
                    gpus: list[dict[str, Any]] | None = None) -> threading.Thread:
    """Register now and every BEAT_S seconds until `stop` is set (a daemon thread)."""

    def beat() -> None:
        while True:
            try:
                with database.session() as db:
                    register(db, name, slots, gpus=gpus)
                    db.commit()
            except Exception as exc:  # the database may be restarting; the next beat may get through
                log.warning("learner host %s could not register: %s", name, exc)
            if stop.wait(BEAT_S):
                return

    thread = threading.Thread(target=beat, name="learner-host-registration", daemon=True)
    thread.start()
    return thread
