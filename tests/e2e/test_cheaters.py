"""Rational cheaters against a running stack (API, Celery scheduler, learner host and two honest local workers
as real processes): each cheat of issue 27 (tests/cheaters.py) mounted over HTTP by a worker of its own
provider, all during one job, each recomputing its logprobs honestly so that only the replay audit can see it.

Every cheater is quarantined within 20 of its groups, every one of its audited groups that the replay could
judge against the sampler fails it (the cheats that change seeds or samples always; those that sample a
nearby model or an old version wherever the two models rank the top candidates differently, which on this
tiny model is in most 24-token groups), and it ends with $0.00 net pay in the ledger: what it was paid
before it was caught is clawed back. The honest workers are never struck. The catch rates over thousands of
groups, on SmolLM2 and both backends, are bench/audit.py's (docs/RELIABILITY.md).
"""

from __future__ import annotations

import httpx
import pytest
from echo2 import Client
from sqlalchemy import select

from api.db import Database
from api.models import Audit, LedgerEntry, Rollout, Worker
from api.settings import Settings
from server.demo import demo_spec
from server.local import free_port
from server.stack import Stack
from tests.cheaters import CHEATS, Cheater
from tests.e2e.test_attacks import wait_for

pytestmark = pytest.mark.e2e
STEPS = 40
SEEDS_CHANGE = ("copy", "eos", "pick")  # cheats whose samples are not the leased seeds' draws at all


def register(url: str, admin_key: str, name: str) -> tuple[str, str]:
    """A provider of its own and one worker of it (memory, price and speed are claims, measured later)."""
    admin = {"Authorization": f"Bearer {admin_key}"}
    provider = httpx.post(f"{url}/v1/providers", json={"name": name}, headers=admin, timeout=30).json()["token"]
    body = httpx.post(f"{url}/v1/workers", json={"name": name, "vram_gb": 24, "price_per_hour": 0.01},
                      headers={"Authorization": f"Bearer {provider}"}, timeout=30).json()
    return body["worker"]["id"], body["token"]


def test_rational_cheaters_are_caught_quarantined_and_paid_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_LOG_LEVEL", "WARNING")
    settings = Settings(data_dir=tmp_path / ".echo2", port=free_port())
    stack = Stack(settings, workers=2).start()
    db = Database(settings.database_url)
    cheaters: dict[str, Cheater] = {}
    try:
        with Client(base_url=stack.url, api_key=stack.admin_key) as client:
            job = client.jobs.create(demo_spec("tiny", STEPS, 2))
            for cheat in CHEATS:
                wid, token = register(stack.url, stack.admin_key, cheat)
                cheaters[cheat] = Cheater(cheat, stack.url, wid, token, tmp_path / cheat).start()
            wait_for(lambda: _all_shut_out(db, CHEATS), stack, "every cheater is quarantined")
            wait_for(lambda: client.jobs.get(job.id).status.is_terminal(), stack, "the job finishes")
            final = client.jobs.get(job.id)
    finally:
        for driver in cheaters.values():
            driver._stop.set()
        stack.stop()
    assert final.status.value == "succeeded", final
    with db.session() as s:
        workers = {w.name: w for w in s.scalars(select(Worker))}
        rollouts = list(s.scalars(select(Rollout).order_by(Rollout.created_at)))
        audits = list(s.scalars(select(Audit)))
        ledger = list(s.scalars(select(LedgerEntry).where(LedgerEntry.worker_id.is_not(None))))
    for cheat in CHEATS:
        w = workers[cheat]
        mine = [r for r in rollouts if r.worker_id == w.id]
        judged = [a for a in audits if a.worker_id == w.id and a.stats.get("replayed")]
        assert w.trust in ("quarantined", "banned"), (cheat, w.trust, w.trust_reason)
        assert len(mine) <= 20 + 8, (cheat, len(mine))  # shut out within 20 groups (one lease may be in flight)
        if cheat in SEEDS_CHANGE:
            assert judged and all(not a.passed for a in judged), (cheat, [a.reason for a in judged])
        assert sum(e.amount_usd for e in ledger if e.worker_id == w.id) == pytest.approx(0.0, abs=1e-12), cheat
    for name in ("local-0", "local-1"):
        honest = workers[name]
        assert honest.audits_failed == 0 and honest.strikes == 0, (name, honest.trust_reason)
        assert any(r.status == "trained" for r in rollouts if r.worker_id == honest.id)


def _all_shut_out(db: Database, names: tuple[str, ...]) -> bool:
    with db.session() as s:
        states = dict(s.execute(select(Worker.name, Worker.trust).where(Worker.name.in_(names))).all())
    return len(states) == len(names) and all(str(t) in ("quarantined", "banned") for t in states.values())
