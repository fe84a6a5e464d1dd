"""Off-policy corrections through the whole learning path: a job asking for one gets it, and the mismatch
it corrects shows in the job's metrics (tests/learner/test_policy.py shows each correction's effect on the
update, tests/api/test_telemetry.py the series on /metrics). The learner process runs against a live
control plane; a real transformers worker generates from the published versions. One job's worker reports
its behaviour logprobs as they are, the other's lowers each by up to 0.45 nats (another behaviour policy,
within what an audit tolerates), so the learner's weights are up to e^0.45 = 1.57 times the behaviour's."""

from __future__ import annotations

import random
from typing import Any

import pytest

from server.demo import demo_spec
from tests.factories import activate, new_provider, new_user, new_worker, ok
from tests.learner.live import finish, start_learner
from tests.rollout_driver import RolloutDriver

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)]
STEPS = 4


def _lowered(groups: list[dict[str, Any]]) -> None:
    rng = random.Random(0)
    for group in groups:
        for sample in group["samples"]:
            sample["logprobs"] = [lp - rng.uniform(0.0, 0.45) for lp in sample["logprobs"]]


def _run(api, tmp_path, forge) -> tuple[Any, str]:
    _, alice = new_user(api)
    spec = demo_spec("tiny", STEPS, staleness=0)
    spec["grpo"].update(correction="mis", correction_high=1.2)
    job = ok(alice.post("/v1/jobs", json=spec), 201)
    live = start_learner(api, job["id"], tmp_path / "learner")
    _, provider = new_provider(api)
    wid, client = new_worker(api, provider, "w")
    activate(api, wid, job["id"])
    driver = RolloutDriver(api.url, wid, client.headers["Authorization"].split()[1], tmp_path / "w",
                           forge=forge).start()
    finish(live, [driver], timeout_s=300, poll_s=0.5)
    assert ok(alice.get(f"/v1/jobs/{job['id']}"))["status"] == "succeeded"
    return alice, job["id"]


def test_a_jobs_correction_masks_what_the_behaviour_perturbs(api, tmp_path):
    seen = {}
    for name, forge in (("honest", None), ("lowered", _lowered)):
        alice, job_id = _run(api, tmp_path / name, forge)
        rows = [next(r for r in m["mismatch"] if r["staleness"] == -1)
                for m in ok(alice.get(f"/v1/jobs/{job_id}/metrics")) if m["mismatch"]]
        assert rows, "no step reported its mismatch"
        seen[name] = rows
    honest, lowered = seen["honest"], seen["lowered"]
    assert all(r["kl"] < 1e-6 and r["masked"] == 0.0 and r["ess"] > 0.999 for r in honest)
    # w = e^d with d uniform in [0, 0.45]: tokens with d > ln 1.2 = 0.18 are masked, about 59 % of them
    assert all(0.4 < r["masked"] < 0.8 for r in lowered), lowered
    assert all(r["kl"] > 0.01 and r["ess"] < 0.999 for r in lowered), lowered
