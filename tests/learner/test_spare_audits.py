"""Audits in the learner's spare time, against a live control plane with real rollouts from the tiny model.

A trusted worker has one group in each window of W = 10 audited (trust.should_audit). While a step waits for
rollouts, the learner audits groups the control plane did not pick (Learner._audit_spare). Here two trusted
workers, one honest and one whose groups fail every audit but pass the door (each logprob reported 1 nat low;
not a group the door flags as duplicated, which is audited whatever its sender's trust), each with an audit salt
whose first window picks its last group. The learner waits for rollouts at the start of the job, while the first
groups trickle in: groups of the cheater that no window picked fail their audits, it is quarantined, and the
honest worker is never struck. (While the queue holds a step's groups, a claim returns full: the learner does not
wait, and audits only what was picked.)"""

from __future__ import annotations

import hashlib

import pytest
from echo2.protocol import TrustState
from sqlalchemy import select

from api.models import Audit, Rollout, Worker
from server.demo import demo_spec
from tests.factories import activate, new_provider, new_user, new_worker, ok
from tests.learner.live import finish, start_learner
from tests.rollout_driver import RolloutDriver

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
STEPS = 12
WINDOW = 10  # round(1 / audit_rate) at the default rate


def _salt_picking_last() -> str:
    """A salt whose first audit window picks its last group (the slot is sha256(salt:0) mod W)."""
    return next(salt for salt in (f"salt-{i}" for i in range(10_000))
                if int.from_bytes(hashlib.sha256(f"{salt}:0".encode()).digest()[:8], "big") % WINDOW == WINDOW - 1)


def _trusted(api, worker_id: str, salt: str) -> None:
    with api.db.session() as s:
        worker = s.get(Worker, worker_id)
        worker.trust, worker.audits_passed, worker.audit_salt = TrustState.trusted, 5, salt
        s.commit()


def _worker(api, job_id: str, name: str, salt: str) -> tuple[str, str]:
    _, provider = new_provider(api, name)
    wid, client = new_worker(api, provider, name)
    activate(api, wid, job_id)
    _trusted(api, wid, salt)
    return wid, client.headers["Authorization"].split()[1]


def _one_nat_low(groups: list[dict]) -> None:
    for group in groups:
        for sample in group["samples"]:
            sample["logprobs"] = [lp - 1.0 for lp in sample["logprobs"]]


def test_a_trusted_cheater_is_struck_by_an_audit_no_window_picked(api, tmp_path):
    _, alice = new_user(api)
    job = ok(alice.post("/v1/jobs", json=demo_spec("tiny", STEPS, 2)), 201)
    live = start_learner(api, job["id"], tmp_path / "learner")
    salt = _salt_picking_last()
    honest_id, honest_token = _worker(api, job["id"], "honest", salt)
    cheater_id, cheater_token = _worker(api, job["id"], "cheater", salt)
    drivers = [RolloutDriver(api.url, honest_id, honest_token, tmp_path / "honest").start(),
               RolloutDriver(api.url, cheater_id, cheater_token, tmp_path / "cheater", forge=_one_nat_low).start()]
    finish(live, drivers, timeout_s=600, poll_s=1)
    assert ok(alice.get(f"/v1/jobs/{job['id']}"))["status"] == "succeeded"

    with api.db.session() as s:
        workers = {w.id: w for w in s.scalars(select(Worker).where(Worker.id.in_([honest_id, cheater_id])))}
        numbered = {w: sorted(r.seq for r in s.scalars(select(Rollout).where(Rollout.worker_id == w))
                              if r.seq is not None) for w in workers}
        audited = {w: [(a.passed, s.get(Rollout, a.rollout_id).seq) for a in s.scalars(
            select(Audit).where(Audit.worker_id == w).order_by(Audit.id))] for w in workers}
    cheater, honest = workers[cheater_id], workers[honest_id]
    assert cheater.trust in (TrustState.quarantined, TrustState.banned), cheater.trust_reason
    # Its first window picks group W - 1, and groups are claimed in order: 0 .. W - 2 were claimed no later than
    # W - 1, before any verdict on it, so none of them was picked, and an audit of one is a spare one.
    spare = [seq for passed, seq in audited[cheater_id] if seq < WINDOW - 1]
    assert spare and all(not passed for passed, _ in audited[cheater_id]), audited[cheater_id]
    assert honest.strikes == 0 and honest.audits_failed == 0, honest.trust_reason
    assert all(passed for passed, _ in audited[honest_id]) and numbered[honest_id]
