"""The Tinker API sampling on the worker fleet, tried as a hostile worker would (issue 18).

A whole stack as real processes (API, Celery scheduler, learner host, Tinker learner host, one honest local
worker) and the unmodified `tinker` SDK (tests/tinker/fleet_flow.py, in .venv-tinker): a LoRA training client
saves weights for a sampler, the scheduler activates workers for the model's fleet job, and the samples the
SDK gets are drawn by a worker. Beside it, a forger registered at the lowest price: it never loads a model,
claims to hold whatever version it is told to (fetching from the origin only the bytes each possession
challenge asks about), and answers every request it leases with invented tokens of the right shape and
plausible logprobs, which pass the door. The learner host audits its groups, so:
no forged token reaches the SDK (every sequence it got scores, under the checkpoint, as its logprobs say), the
forger is quarantined with the evidence and paid nothing, and the honest worker is paid for what it drew.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from api.db import Database
from api.models import Audit, Job, LedgerEntry, Rollout, Worker
from api.settings import Settings
from api.tinker.models import TinkerRequest
from server.local import free_port
from server.stack import Stack
from tests.e2e.test_attacks import register, wait_for
from tests.tinker.conftest import tinker_sdk_python

pytestmark = pytest.mark.e2e
FLOW = Path(__file__).parents[1] / "tinker" / "fleet_flow.py"
WANT = 12  # groups the fleet must deliver before the SDK stops sampling
VOCAB = 96  # the tiny model's


class Forger(threading.Thread):
    """A worker that draws nothing: invented groups of exactly the shape each request asks for."""

    def __init__(self, url: str, worker_id: str, token: str) -> None:
        super().__init__(daemon=True)
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        self.worker_id, self.stop, self.results = worker_id, threading.Event(), []
        self.rng, self.held, self.proofs = random.Random(0), None, []

    def run(self) -> None:
        while not self.stop.wait(0.2):
            reply = self.http.post(f"/v1/workers/{self.worker_id}/heartbeat",
                                   json={"status": "active", "version_held": self.held, "proofs": self.proofs}).json()
            assignment = reply.get("assignment")
            if reply.get("desired") != "active" or not assignment:
                continue
            self.proofs = [self._prove(assignment["job_id"], c) for c in assignment["challenges"]]
            if self.held != assignment["version"]:
                self.held = assignment["version"]  # "downloaded" at once; the next heartbeat says it holds it
                continue
            lease = self.http.post("/v1/leases", json={"job_id": assignment["job_id"], "max_prompts": 8,
                                                       "version": self.held})
            if lease.status_code == 201:
                self._forge(lease.json())

    def _prove(self, job_id: str, challenge: dict) -> dict:
        """The challenged bytes, from the chunks of the origin that hold them: proof of possession cannot tell
        this from holding the version (docs/RELIABILITY.md); the audits must catch what it draws."""
        base = f"/v1/jobs/{job_id}/versions/{challenge['version']}"
        size = self.http.get(f"{base}/manifest").raise_for_status().json()["chunk_size"]
        start, end = challenge["offset"], challenge["offset"] + challenge["length"]
        data = b"".join(self.http.get(f"{base}/chunks/{i}").raise_for_status().content
                        for i in range(start // size, (end - 1) // size + 1))
        skip = start - start // size * size
        return {**challenge, "sha256": hashlib.sha256(data[skip:skip + challenge["length"]]).hexdigest()}

    def _forge(self, lease: dict) -> None:
        groups = [{"prompt_id": p["prompt_id"], "version": lease["version"], "prompt_token_ids": p["token_ids"],
                   "samples": [self._sample(p["sampling"]["max_tokens"]) for _ in range(p["sampling"]["n"])]}
                  for p in lease["prompts"]]
        answer = self.http.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": groups})
        if answer.status_code == 200:
            self.results += answer.json()["results"]

    def _sample(self, length: int) -> dict:
        return {"token_ids": [self.rng.randrange(VOCAB) for _ in range(length)], "logprobs": [-2.0] * length,
                "finish_reason": "length"}


def run_flow(tinker_python: Path, stack: Stack, home: Path) -> dict:
    env = {**os.environ, "TINKER_BASE_URL": stack.url, "TINKER_API_KEY": f"tml-{stack.admin_key}", "HOME": str(home)}
    out, err = home / "flow.out", home / "flow.err"  # files, not pipes: the SDK logs more than a pipe holds
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen([str(tinker_python), str(FLOW), "echo2:tiny", str(WANT), "420"], env=env,
                                stdout=stdout, stderr=stderr)
        deadline = time.monotonic() + 600
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the SDK flow did not finish in 600 s"
            stack.supervise()
            time.sleep(1)
    assert proc.returncode == 0, err.read_text()[-6000:]
    return json.loads(out.read_text().strip().splitlines()[-1])


def test_the_tinker_sdk_samples_from_the_worker_fleet_and_a_forger_is_caught(tmp_path, monkeypatch):
    tinker_python = tinker_sdk_python()
    monkeypatch.setenv("ECHO2_LOG_LEVEL", "WARNING")
    settings = Settings(data_dir=tmp_path / ".echo2", port=free_port())
    stack = Stack(settings, workers=1, tinker_slots=1).start()
    db = Database(settings.database_url)
    forger = Forger(stack.url, *register(stack.url, stack.admin_key, "forger", price_per_hour=0.001,
                                         rollouts_per_s=1000))
    forger.start()
    try:
        seen = run_flow(tinker_python, stack, tmp_path)
        with db.session() as s:
            job = s.scalar(select(Job).where(Job.tinker_model_id == seen["model_id"]))
            assert job is not None, "no fleet job was made for the model"
        honest_paid = select(LedgerEntry).where(LedgerEntry.kind == "worker", LedgerEntry.job_id == job.id)
        wait_for(lambda: _rows(db, honest_paid), stack, "the fleet's worker is paid", timeout=120)
    finally:
        forger.stop.set()
        stack.stop()

    assert seen["delivered"] >= WANT, seen["delivered"]
    _every_sample_is_the_checkpoints(seen["samples"])
    with db.session() as s:
        workers = {w.name: w for w in s.scalars(select(Worker))}
        rows = list(s.scalars(select(Rollout).where(Rollout.job_id == job.id)))
        answered = [r.result for r in s.scalars(select(TinkerRequest).where(
            TinkerRequest.kind == "sample", TinkerRequest.status == "done"))]
        failed_audits = list(s.scalars(select(Audit).where(Audit.passed.is_(False))))
        paid = list(s.scalars(select(LedgerEntry).where(LedgerEntry.kind == "worker")))
    forger_row, honest = workers["forger"], workers["local-0"]
    by_fleet = [r["worker"] for r in answered if "worker" in r]
    assert len(by_fleet) >= WANT and set(by_fleet) == {honest.id}, by_fleet  # drawn by the honest worker only
    mine = [r for r in rows if r.worker_id == forger_row.id]
    assert forger.results and mine, "the forger never got to submit (not activated?)"
    assert all(r.status == "rejected" for r in mine)
    assert any(r.reject_kind == "audit_failed" for r in mine)
    assert forger_row.trust in ("quarantined", "banned"), forger_row.trust
    assert {a.worker_id for a in failed_audits} == {forger_row.id}
    assert not [e for e in paid if e.worker_id == forger_row.id]
    assert {e.worker_id for e in paid} == {honest.id} and sum(e.groups for e in paid) >= 1


def _every_sample_is_the_checkpoints(samples: list[dict]) -> None:
    """The learner host scores each sequence the SDK got under the checkpoint it sampled: the logprobs it came
    with are those (an invented token, or an invented logprob, would be far off)."""
    assert len(samples) >= 4 * WANT // 4
    for s in samples:
        assert len(s["tokens"]) == len(s["logprobs"]) == len(s["scored"]) >= 1
        assert max(abs(a - b) for a, b in zip(s["logprobs"], s["scored"], strict=True)) < 1e-3, s


def _rows(db: Database, query) -> list:  # type: ignore[no-untyped-def]
    with db.session() as s:
        return list(s.scalars(query))
