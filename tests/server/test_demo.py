"""What the demo prints while it follows its job: what the job is doing while its learner starts (the
terminal used to say nothing for minutes after "submitted"), a legend for the staleness histogram, and a
summary that says why the training reward and the held-out accuracy differ."""

import io
import threading
import time

from echo2 import Client

from server.demo import STALENESS_LEGEND, _follow, summary
from tests.factories import new_job, new_user, ok, start_learner


def test_the_demo_says_what_its_job_is_doing_while_the_learner_starts(api):
    _, alice = new_user(api)
    job = new_job(alice)
    learner = start_learner(api, job["id"])
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/heartbeat",
                    json={"step": 0, "state": "starting: loading the model"}))
    out = io.StringIO()
    with Client(api.url, alice.headers["Authorization"].split()[1]) as client:
        follower = threading.Thread(target=_follow, args=(client, job["id"], out), daemon=True)
        follower.start()
        time.sleep(1.5)
        ok(alice.post(f"/v1/jobs/{job['id']}/cancel"))
        follower.join(30)
        lines = [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
        assert lines == ["running (its learner is starting: loading the model)", "cancelled (cancelled by alice)"]
        final, report = client.jobs.get(job["id"]), client.jobs.report(job["id"])
    said = "\n".join(summary(final, report, [0.02, 0.02], 60.0))
    assert "training reward 0.02 -> 0.02" in said
    assert "held-out: the model's greedy answers to problems it never trained on" in said
    assert "drawn at temperature 1 for each step's groups" in said
    assert STALENESS_LEGEND.startswith("staleness a:n = n of the step's groups were made by the policy a versions")
