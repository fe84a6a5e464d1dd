"""Hostile workers against a running stack (API, Celery scheduler, learner host and an honest local worker
as real processes), each attack as a real worker would mount it over HTTP with nothing but a provider
token, all during one job:

1. the stalled-job attack: groups with forged behaviour logprobs (the -1e4 of the finding is refused
   at the door; -20 passes it and goes to the learner) — the job finishes, every poisoned group is
   dropped, the sender is quarantined with the evidence;
2. the billing attack: a worker at $10,000/h that claims 1e6 rollouts/s and heartbeats `active` but
   never leases — it is billed $0.00 and deactivated once it has delivered nothing for the grace time;
3. rollouts not from the model: random tokens with logprob 0.0 (caught by the audit), token ids
   beyond the vocabulary and 16,000-token samples (refused at the door), and a `text` that differs
   from the tokens (never shown).
The relay attacks of finding 4 are tried in tests/api/test_fleet.py and tests/scheduler/test_relay_probe.py.
"""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest
from echo2 import Client
from echo2.protocol import Fault, RejectKind
from sqlalchemy import select

from api.db import Database
from api.models import LedgerEntry, Rollout, Worker
from api.settings import Settings
from server.demo import demo_spec
from server.local import free_port
from server.stack import Stack
from tests.rollout_driver import RolloutDriver

pytestmark = pytest.mark.e2e
STEPS = 60
VOCAB = 96  # the tiny model's


def forge_logprobs(groups):
    for g in groups:
        for s in g["samples"]:
            s["logprobs"] = [-20.0] * len(s["token_ids"])  # above the door's floor, far from the truth


def forge_tokens(groups):
    rng = random.Random(0)
    for g in groups:
        for s in g["samples"]:
            # random tokens (the last one kept, so an eos still ends a "stop" sample as the door checks)
            s["token_ids"] = [rng.randrange(VOCAB) for _ in s["token_ids"][:-1]] + s["token_ids"][-1:]
            s["logprobs"] = [0.0] * len(s["token_ids"])
            s["text"] = "the answer is 42"


def forge_shapes(groups):
    groups[0]["samples"][0]["token_ids"][0] = VOCAB + 7
    if len(groups) > 1:
        groups[1]["samples"][0].update(token_ids=[5] * 16_000, logprobs=[-4.0] * 16_000, finish_reason="length")


class Idler(threading.Thread):
    """Finding 2: registered at $10,000/h claiming 1e6 rollouts/s; heartbeats `active`, never leases."""

    def __init__(self, url: str, worker_id: str, token: str) -> None:
        super().__init__(daemon=True)
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        self.worker_id, self.stop, self.replies = worker_id, threading.Event(), []

    def run(self) -> None:
        while not self.stop.wait(1.0):
            reply = self.http.post(f"/v1/workers/{self.worker_id}/heartbeat", json={"status": "active"})
            self.replies.append(reply.json())


def wait_for(predicate, stack, what: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        stack.supervise()
        time.sleep(0.5)


def register(url: str, admin_key: str, name: str, **fields) -> tuple[str, str]:
    admin = {"Authorization": f"Bearer {admin_key}"}
    provider = httpx.post(f"{url}/v1/providers", json={"name": name}, headers=admin, timeout=30).json()["token"]
    body = httpx.post(f"{url}/v1/workers", json={"name": name, "vram_gb": 24, **fields},  # memory is a claim too
                      headers={"Authorization": f"Bearer {provider}"}, timeout=30).json()
    return body["worker"]["id"], body["token"]


def test_hostile_workers_cannot_stall_poison_or_bill_a_job(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_DELIVERY_GRACE_S", "15")
    monkeypatch.setenv("ECHO2_LOG_LEVEL", "WARNING")
    settings = Settings(data_dir=tmp_path / ".echo2", port=free_port())
    stack = Stack(settings, workers=1).start()
    db = Database(settings.database_url)
    attackers: dict[str, RolloutDriver] = {}
    try:
        url = stack.url
        idler = Idler(url, *register(url, stack.admin_key, "idler", price_per_hour=10_000, rollouts_per_s=1e6))
        idler.start()
        with Client(base_url=url, api_key=stack.admin_key) as client:
            job = client.jobs.create(demo_spec("tiny", STEPS, 2))
            for name, forge in (("poisoner", forge_logprobs), ("random", forge_tokens), ("shapes", forge_shapes)):
                wid, token = register(url, stack.admin_key, name, price_per_hour=0.01)
                attackers[name] = RolloutDriver(url, wid, token, tmp_path / name, forge=forge).start()
            wait_for(lambda: all(d.results for d in attackers.values()), stack, "every attacker submits")
            wait_for(lambda: client.jobs.get(job.id).status.is_terminal(), stack, "the job finishes")
            final = client.jobs.get(job.id)
            failed_audits = client.jobs.audits(job.id, passed=False, limit=200)
            shown = [c for r in client.jobs.rollouts(job.id, limit=200).items for c in r.completions]
    finally:
        idler.stop.set()
        for driver in attackers.values():
            driver._stop.set()
        stack.stop()
    assert final.status.value == "succeeded" and final.step == STEPS, final
    with db.session() as s:
        workers = {w.name: w for w in s.scalars(select(Worker))}
        rows = list(s.scalars(select(Rollout)))
        ledger = list(s.scalars(select(LedgerEntry).where(LedgerEntry.kind == "worker")))
    by_worker = {name: [r for r in rows if r.worker_id == w.id] for name, w in workers.items()}
    for name in ("poisoner", "random", "shapes"):  # nothing of theirs was trained, each was shut out
        assert by_worker[name], f"{name} never got to submit (not activated?)"
        assert all(r.status == "rejected" for r in by_worker[name]), name
        assert any(RejectKind(r.reject_kind).fault() is Fault.worker for r in by_worker[name]), name
        assert workers[name].trust in ("quarantined", "banned"), (name, workers[name].trust)
    assert {a.worker_id for a in failed_audits} >= {workers["poisoner"].id, workers["random"].id}
    assert any("logprob" in r.reason for r in by_worker["poisoner"])
    assert any("outside the vocabulary" in r.reason for r in by_worker["shapes"])
    assert "the answer is 42" not in shown
    honest = by_worker["local-0"]
    assert any(r.status == "trained" for r in honest)
    assert workers["idler"].earned_usd == 0.0 and not [e for e in ledger if e.worker_id == workers["idler"].id]
    assert workers["idler"].job_id is None  # deactivated: it delivered nothing
    assert not [e for e in ledger if e.worker_id in {workers[n].id for n in ("poisoner", "random", "shapes")}]
