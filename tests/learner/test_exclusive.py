"""One learner of a job per host: a duplicate launch returns, a newer one waits (learner/exclusive.py)."""

import threading

from learner.exclusive import sole_learner
from learner.launch import run_job
from learner.loop import LearnerOptions


def test_a_duplicate_launch_returns_at_once_without_calling_the_control_plane(tmp_path):
    with sole_learner(tmp_path, "job-1", "token-a") as first:
        assert first
        # The server address is unreachable: a run_job that got past the lock would raise.
        run_job("http://127.0.0.1:9", "token-a", "job-1", LearnerOptions(work_dir=tmp_path))


def test_a_newer_launch_waits_for_the_older_learner_to_stop(tmp_path):
    events: list[str] = []
    holding, release = threading.Event(), threading.Event()

    def older() -> None:
        with sole_learner(tmp_path, "job-1", "token-a") as sole:
            assert sole
            holding.set()
            release.wait(10)
            events.append("older stopped")

    def newer() -> None:
        with sole_learner(tmp_path, "job-1", "token-b") as sole:
            events.append(f"newer started ({sole})")

    threads = [threading.Thread(target=older)]
    threads[0].start()
    assert holding.wait(10)
    threads.append(threading.Thread(target=newer))
    threads[1].start()
    threads[1].join(0.5)
    assert threads[1].is_alive() and events == []  # blocked behind the older learner
    release.set()
    for t in threads:
        t.join(10)
    assert events == ["older stopped", "newer started (True)"]


def test_other_jobs_are_not_held_up(tmp_path):
    with sole_learner(tmp_path, "job-1", "token-a"), sole_learner(tmp_path, "job-2", "token-b") as other:
        assert other
