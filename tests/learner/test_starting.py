"""A learner heartbeats from the moment it starts: preparing the base model, loading it, the first
publication and evaluation take minutes for a real model, and a learner silent for `learner_dead_after_s`
used to be relaunched by the scheduler while the first was still converting (and then died on a 401). What it
is doing is the job's status_reason meanwhile; a cancelled job's learner stops quietly."""

import time

import pytest

from api.models import Job
from server.demo import demo_spec
from tests.factories import new_user, ok
from tests.learner.live import start_learner

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

PHASES = [f"its learner is starting: {phase}" for phase in (
    "preparing the base model echo2:tiny (a built-in is converted once)", "loading the model",
    "publishing the first version for the workers", "evaluating on")]


def _in_order(seen: list[str], phases: list[str]) -> bool:
    """Each reason seen is one of the phases (an evaluation names its prompt count), in the learner's order."""
    at = [next((i for i, p in enumerate(phases) if s.startswith(p)), -1) for s in seen]
    return -1 not in at and at == sorted(at)


def test_a_starting_learner_heartbeats_and_says_what_it_does(api, tmp_path):
    _, alice = new_user(api)
    job = ok(alice.post("/v1/jobs", json=demo_spec("tiny", 2, 1)), 201)
    live = start_learner(api, job["id"], tmp_path / "learner", heartbeat_s=0.05)
    seen: list[str] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        got = ok(alice.get(f"/v1/jobs/{job['id']}"))
        if got["status_reason"] and got["status_reason"] not in seen:
            seen.append(got["status_reason"])
        if got["version"] is not None or not live.thread.is_alive():
            break
        time.sleep(0.02)
    # Heartbeats every 50 ms: which phases outlast one beat depends on the machine's load, but what
    # is seen is said in the learner's order, and the job is never silent while it starts.
    assert seen and _in_order(seen, PHASES), seen
    ok(alice.post(f"/v1/jobs/{job['id']}/cancel"))  # its token is revoked: it stops at its next call
    live.thread.join(60)
    live.plane.close()
    assert not live.thread.is_alive()
    with api.db.session() as s:
        assert s.get_one(Job, job["id"]).learner_error is None  # stopped, not crashed
