"""The version watcher against a real control plane: one notice per piece of news, however long the worker
takes to catch up with it through its heartbeat."""

from __future__ import annotations

import time
from pathlib import Path

from echo2_worker.control import ControlPlane
from echo2_worker.notice import VersionWatcher

from tests.conftest import Api
from tests.factories import activate, ok, publish

from .conftest import register, start_job, wait_for


def test_news_is_passed_on_once_while_the_worker_has_not_caught_up(api: Api, tiny_model_dir: Path,
                                                                   next_model_dir: Path) -> None:
    """The worker's own view (from its heartbeat replies) stays at version 0 here: the watcher used to ask again
    with version 0 at once, be answered at once, and loop, about ten requests and log lines a second."""
    setup = start_job(api, tiny_model_dir)
    worker_id, token = register(api, setup, "w")
    activate(api, worker_id, setup.id)  # a worker hears of the job it is assigned to
    control, polls, news = ControlPlane(api.url, token), [], []
    asked = control.wait_for_version
    control.wait_for_version = lambda *a, **kw: polls.append(a) or asked(*a, **kw)  # type: ignore[method-assign]
    watcher = VersionWatcher(control, lambda: (setup.id, 0), lambda: news.append(time.monotonic()))
    watcher.start()
    try:
        wait_for(lambda: polls, 10, "the first poll")
        publish(setup.learner, setup.id, next_model_dir, version=1, step=1)
        wait_for(lambda: news, 10, "the notice of version 1")
        time.sleep(2)
        assert len(news) == 1 and len(polls) <= 3, (news, polls)
        ok(setup.learner.post(f"/v1/jobs/{setup.id}/learner/finish", json={"outcome": "succeeded",
                                                                           "final_version": 1}))
        wait_for(lambda: len(news) == 2, 10, "the notice that the job ended")
        seen = len(polls)
        time.sleep(2)
        assert len(news) == 2 and len(polls) == seen  # an ended job is not polled again
    finally:
        watcher.stop()
