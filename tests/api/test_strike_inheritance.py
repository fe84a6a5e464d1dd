"""Strikes a provider's new worker starts with (trust.inherit_strikes), and whose pay its quarantine claws back.

a6100b3 passed on the strikes of workers "gone" (offline, even for 15 s, or deleted), kept a deleted worker's strike
after its successor worked it off, let a struck worker kept heartbeating shed nothing, and clawed back on any
quarantine every struck worker of the provider that happened to be offline. Now a new worker starts with the strikes
of its provider's most struck worker, a deleted one's moving to it, and a quarantine claws back only the deleted
workers whose strikes the quarantined one carries on."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select

from api.models import Audit, LedgerEntry, Worker, utcnow
from api.services import trust
from tests.factories import fake_model_folder, new_provider, new_user, new_worker, ok, paid_job, running_job


def _strike(api, wid: str, times: int = 1) -> None:
    with api.db.session() as s:
        w = s.get_one(Worker, wid)
        for _ in range(times):
            trust.strike(s, w, "replay: a token the claimed version does not draw", api.server.settings, audited=True)
        s.commit()


def _offline_for(api, wid: str, seconds: float) -> None:
    """What the scheduler's _mark_offline does to a worker that missed heartbeats for `seconds` (> 15 s)."""
    with api.db.session() as s:
        w = s.get_one(Worker, wid)
        w.status, w.last_heartbeat_at = "offline", utcnow() - timedelta(seconds=seconds)
        s.commit()


def _strikes(api, wid: str) -> int:
    with api.db.session() as s:
        return s.get_one(Worker, wid).strikes


def _kept_usd(api, wid: str) -> float:
    with api.db.session() as s:
        return sum(e.amount_usd for e in s.scalars(select(LedgerEntry).where(
            LedgerEntry.worker_id == wid, LedgerEntry.kind == "worker", LedgerEntry.clawed_back_by.is_(None))))


def test_a_quarantine_does_not_claw_back_an_unrelated_worker_that_is_briefly_offline(api, tmp_path):
    _, provider = new_provider(api, "big-honest-co")
    a = new_worker(api, provider, "machine-a")
    x = new_worker(api, provider, "machine-x")  # registered with a: it inherited nothing from anyone
    paid_job(api, fake_model_folder(tmp_path / "m"), [a, x])
    paid_a = _kept_usd(api, a[0])
    assert paid_a > 0
    _strike(api, a[0])  # one strike (a suspect), its work paid long before it
    _offline_for(api, a[0], 40)  # a network blip: 40 s without a heartbeat, it comes back in a moment
    _strike(api, x[0], 2)  # another machine of the provider is quarantined for its own two strikes
    assert ok(api.admin.get(f"/v1/workers/{x[0]}"))["trust"] == "quarantined"
    assert _kept_usd(api, a[0]) == paid_a, (
        f"machine-a (1 strike, offline 40 s, never replaced by anyone) lost all its pay ({paid_a:.2f} USD -> "
        f"{_kept_usd(api, a[0]):.2f}) because machine-x, registered before it was struck and inheriting nothing, "
        f"was quarantined")


def test_a_struck_machine_back_from_a_reboot_keeps_its_strike_and_its_providers_new_machine_starts_with_it(api):
    """The provider answers for a struck machine it keeps, offline or not: its new machine starts a suspect with the
    strike (its first own strike quarantines it); the struck machine keeps its own."""
    _, provider = new_provider(api, "big-honest-co")
    aid, a = new_worker(api, provider, "machine-a")
    _strike(api, aid)
    _offline_for(api, aid, 60)  # a reboot
    fresh = ok(provider.post("/v1/workers", json={"name": "scale-up-1", "vram_gb": 16}), 201)["worker"]
    ok(a.post(f"/v1/workers/{aid}/heartbeat", json={"versions_held": []}))  # machine-a is back
    assert ok(api.admin.get(f"/v1/workers/{aid}"))["status"] != "offline" and _strikes(api, aid) == 1
    assert fresh["trust"] == "suspect" and _strikes(api, fresh["id"]) == 1
    assert fresh["trust_reason"].startswith(f"worker {aid} of its provider has 1 strike")


def test_a_struck_worker_that_keeps_heartbeating_does_not_let_its_provider_register_a_clean_one(api):
    """Attack 30 without deleting: the provider keeps its struck worker heartbeating (a loop of HTTP calls, no GPU)
    and registers another machine, which started clean after a6100b3."""
    _, provider = new_provider(api, "mallory-gpu")
    aid, a = new_worker(api, provider, "machine-1")
    _strike(api, aid)  # caught forging once: a suspect, one strike from quarantine
    ok(a.post(f"/v1/workers/{aid}/heartbeat", json={"versions_held": []}))  # kept alive, idle, forever
    fresh = ok(provider.post("/v1/workers", json={"name": "machine-2", "vram_gb": 16}), 201)["worker"]
    assert _strikes(api, fresh["id"]) >= 1 and fresh["trust"] == "suspect", (
        f"machine-1 struck and kept heartbeating (status {ok(api.admin.get(f'/v1/workers/{aid}'))['status']}); "
        f"machine-2 registers {fresh['trust']} with {_strikes(api, fresh['id'])} strikes: the strike is shed without "
        "deleting")


def test_a_strike_forgiven_on_the_successor_is_not_passed_on_again(api, monkeypatch):
    monkeypatch.setattr(trust, "FORGIVE_AFTER", 30)  # 500 in production; the rule is the same
    _, provider = new_provider(api, "honest-gpu")
    aid, a = new_worker(api, provider, "machine-1")
    _strike(api, aid)
    assert a.delete(f"/v1/workers/{aid}").status_code == 204  # re-registered (new relay port: cli.py replaces it)
    succ = ok(provider.post("/v1/workers", json={"name": "machine-1", "vram_gb": 16}), 201)["worker"]
    assert _strikes(api, succ["id"]) == 1
    with api.db.session() as s:
        w = s.get_one(Worker, succ["id"])
        for _ in range(30):  # clean audits in a row: the strike is forgiven
            trust.passed(s, w, api.server.settings)
        s.commit()
    assert _strikes(api, succ["id"]) == 0
    fresh = ok(provider.post("/v1/workers", json={"name": "machine-2", "vram_gb": 16}), 201)["worker"]
    assert _strikes(api, fresh["id"]) == 0 and fresh["trust"] == "probation", (
        f"the strike machine-1 carried was forgiven on its successor; machine-2 still starts {fresh['trust']} with "
        f"{_strikes(api, fresh['id'])} strike(s): {fresh['trust_reason']!r}")


def test_a_big_honest_provider_whose_machines_each_hold_one_old_strike_is_not_quarantined(api, tmp_path):
    """A strike lasts FORGIVE_AFTER clean audits: across a provider's many machines, two may each hold one from
    numerics. Its audits pass but for those few, so the provider's strikes do not add up (trust._struck_alongside);
    a provider whose audits fail more than PROVIDER_FAIL_SHARE of the time has its struck workers quarantined."""
    _, provider = new_provider(api, "big-honest-co")
    aid, bid, cid = (new_worker(api, provider, f"machine-{m}")[0] for m in "abc")
    job, _ = running_job(api, new_user(api)[1], fake_model_folder(tmp_path / "m"))
    with api.db.session() as s:
        s.add_all(Audit(job_id=job["id"], worker_id=(aid, bid)[k % 2], rollout_id=f"rol_{k}", version=0, step=0,
                        passed=k > 0) for k in range(300))  # machine-a's one failure among 300 audits
        s.commit()
    _strike(api, aid)
    _strike(api, bid)
    assert {ok(api.admin.get(f"/v1/workers/{w}"))["trust"] for w in (aid, bid)} == {"suspect"}
    with api.db.session() as s:
        s.add_all(Audit(job_id=job["id"], worker_id=cid, rollout_id=f"rol_c{k}", version=0, step=0, passed=False)
                  for k in range(3))  # 4 of 303 failed: more than numerics explain
        s.commit()
    _strike(api, cid)
    assert {ok(api.admin.get(f"/v1/workers/{w}"))["trust"] for w in (aid, bid, cid)} == {"quarantined"}


def _fail_audit(api, wid: str, job_id: str, rid: str) -> None:
    with api.db.session() as s:
        s.add(Audit(job_id=job_id, worker_id=wid, rollout_id=rid, version=0, step=0, passed=False))
        trust.strike(s, s.get_one(Worker, wid), "replay: a token the claimed version does not draw",
                     api.server.settings, audited=True)
        s.commit()


def test_an_honest_provider_that_adds_machines_while_one_holds_an_audited_strike_is_not_quarantined(api, tmp_path):
    """The provider's failure share once counted each inherited strike as one no failed audit explains (review
    finding): the new machines of an honest provider inheriting one machine's numerics strike, then one more honest
    numerics failure, quarantined all twelve."""
    _, provider = new_provider(api, "growing-honest-co")
    aid, bid = (new_worker(api, provider, f"machine-{m}")[0] for m in "ab")
    job, _ = running_job(api, new_user(api)[1], fake_model_folder(tmp_path / "m"))
    with api.db.session() as s:  # a week of honest work: 1,000 audits, all passed
        s.add_all(Audit(job_id=job["id"], worker_id=(aid, bid)[k % 2], rollout_id=f"rol_{k}", version=0, step=0,
                        passed=True) for k in range(1000))
        s.commit()
    _fail_audit(api, aid, job["id"], "rol_a")  # numerics: machine-a fails 1 audit of 1,001, a suspect
    new = [new_worker(api, provider, f"machine-new-{k}")[0] for k in range(10)]  # the provider scales out
    with api.db.session() as s:
        assert all(s.get_one(Worker, w).strikes == 1 for w in new)  # each carries machine-a's strike on
    _fail_audit(api, bid, job["id"], "rol_b")  # numerics again, on another machine: 2 of 1,002 audits failed
    trusts = {w: ok(api.admin.get(f"/v1/workers/{w}"))["trust"] for w in (aid, bid, *new)}
    assert "quarantined" not in trusts.values(), (
        f"2 failed audits in 1,002 (0.2 %, under PROVIDER_FAIL_SHARE 1 %) quarantined the provider's struck workers "
        f"{sorted(w for w, t in trusts.items() if t == 'quarantined')}: the 10 machines it registered after "
        "machine-a's "
        "strike each carry that strike with audits_failed 0, so trust._struck_alongside counts each as a failed "
        "audit no audit explains (12 'failures' > 1 % of 1,012)")
