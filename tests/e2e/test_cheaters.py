"""Rational cheaters against a running stack (API, Celery scheduler, learner host and two honest local workers
as real processes): the cheats of issue 27 (tests/cheaters.py) mounted over HTTP, each by a worker of its own
provider, all during one job, each recomputing its logprobs honestly so that only the replay audit can see it.

Every cheater is quarantined, and ends with $0.00 net pay in the ledger: what it was paid before it was
caught is clawed back. Those whose samples are never the leased seeds' draws (copied, cut short) fail every
audit and are shut out within 20 of their groups (a worker on probation has at most 8 groups waiting for their
verdict). Those that pick or sample an old version pass the audits of the groups that are exactly what the
current version draws with the leased seeds (honest work in all but name: the lowest-reward samples were
the leased ones, the old weights ranked every position alike) and fail, by the replay, every other. The
honest workers are never struck. One more samples an old version as `stale` does but claims bfloat16 and
makes its logprobs noisy to widen the replay's margin to that precision's: it is quarantined and paid nothing
too (in this job a version moves most differing tokens by more than bfloat16's whole margin, so the replay
would catch it without the auditor's shadow as well; what the shadow adds, where versions are closer, is shown
by tests/learner/test_audit.py and measured by bench/replay.py --disguise). The nearby-model cheat (1 % noise) is
left to bench/replay.py: on this tiny model 97 % of its groups are token for token an honest draw, so a job ends
before it has been caught twice; the rates of every cheat over thousands of groups are there
(docs/RELIABILITY.md).
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
from tests.cheaters import Cheater
from tests.e2e.test_attacks import wait_for

pytestmark = pytest.mark.e2e
STEPS = 60
SEEDS_CHANGE = ("copy", "eos")  # cheats whose samples are never the leased seeds' draws
DISGUISED = "stale-as-bf16"  # `stale`, claiming bfloat16 with noisy logprobs (tests/cheaters.py)
MOUNTED = ("stale", "stale3", "pick", *SEEDS_CHANGE, DISGUISED)


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
            for cheat in MOUNTED:
                wid, token = register(stack.url, stack.admin_key, cheat)
                cheaters[cheat] = Cheater(cheat.split("-as-")[0], stack.url, wid, token, tmp_path / cheat,
                                          disguised=cheat == DISGUISED).start()
            wait_for(lambda: _all_shut_out(client, MOUNTED), stack, "every cheater is quarantined")
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
    for cheat in MOUNTED:
        w = workers[cheat]
        mine = [r for r in rollouts if r.worker_id == w.id]
        judged = [a for a in audits if a.worker_id == w.id and a.stats.get("replayed")]
        assert w.trust in ("quarantined", "banned"), (cheat, w.trust, w.trust_reason)
        failed = [a for a in judged if not a.passed]
        assert failed and all(a.reason.startswith("replay:") for a in failed), (cheat, [a.reason for a in failed])
        if cheat in SEEDS_CHANGE:
            assert len(mine) <= 20, (cheat, len(mine))
            assert len(failed) == len(judged), (cheat, [a.reason for a in judged])
        assert sum(e.amount_usd for e in ledger if e.worker_id == w.id) == pytest.approx(0.0, abs=1e-12), cheat
    for name in ("local-0", "local-1"):
        honest = workers[name]
        assert honest.audits_failed == 0 and honest.strikes == 0, (name, honest.trust_reason)
        assert any(r.status == "trained" for r in rollouts if r.worker_id == honest.id)


def _all_shut_out(client: Client, names: tuple[str, ...]) -> bool:
    states = {w.name: w.trust.value for w in client.workers.list(limit=500).items if w.name in names}
    return len(states) == len(names) and all(t in ("quarantined", "banned") for t in states.values())
