"""A real learner in a thread of the test, over HTTP against the `api` fixture's live control plane, and its end."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from learner.loop import Learner, LearnerOptions
from learner.remote import ControlPlane
from tests.factories import learner_for


@dataclass
class LiveLearner:
    plane: ControlPlane
    learner: Learner
    thread: threading.Thread


def start_learner(api: Any, job_id: str, work_dir: Path, heartbeat_s: float = 0.5) -> LiveLearner:
    """The job's learner (one torch thread), running."""
    plane = ControlPlane(api.url, learner_for(api, job_id).headers["Authorization"].split()[1], job_id)
    learner = Learner(plane, LearnerOptions(work_dir=work_dir, heartbeat_s=heartbeat_s, threads=1))
    thread = threading.Thread(target=learner.run, daemon=True)
    thread.start()
    return LiveLearner(plane, learner, thread)


def finish(live: LiveLearner, drivers: list[Any], timeout_s: float, poll_s: float) -> None:
    """Wait up to `timeout_s` for the learner to end its job, stop the rollout drivers, and fail if it did not."""
    deadline = time.monotonic() + timeout_s
    while live.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(poll_s)
    for driver in drivers:
        driver.stop()
    live.plane.close()
    assert not live.thread.is_alive(), "the learner did not finish in time"
