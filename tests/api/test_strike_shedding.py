"""A rational cheating provider sheds a worker's strike by deleting the worker and registering a
fresh one. Attack 20 (turn honest at each strike) was closed by keeping a strike for 500 clean audits
(trust.FORGIVE_AFTER); `_replaces` closed replacing a *quarantined* worker. A worker deleted while it is only a
suspect (one strike) is not covered: the provider's next machine starts on probation with no strike, is trusted
after 5 honest groups, and forges again. Two strikes from one provider's machines, one after the other, never
quarantine anyone, and the forged groups no audit picked stayed paid. A provider's new worker now starts with the
strikes of its provider's most struck worker, as a suspect, and its quarantine claws back the pay of the deleted
workers whose strikes it carries on (RELIABILITY attack 30)."""

from __future__ import annotations

from sqlalchemy import select

from api.models import LedgerEntry, Worker
from api.services.fleet import unassign
from tests.api.test_audit_gaming import _bill, _group, _one_group, _working
from tests.factories import (
    activate,
    fake_model_folder,
    new_provider,
    new_user,
    new_worker,
    ok,
    running_job,
    step_report,
)


def test_a_provider_cannot_shed_a_strike_by_deleting_the_struck_worker_and_registering_another(api, tmp_path):
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=64, max_steps=1000,
                               num_prompts=400, grpo={"group_size": 2, "prompts_per_step": 64})
    jid = job["id"]
    _, provider = new_provider(api, "mallory-gpu")
    forged: set[str] = set()
    state = {"step": 0}

    def send(worker, forge: bool) -> None:
        _one_group(api, worker, learner, jid, state["step"], forged, forge)
        state["step"] += 1

    def trust(wid, worker) -> str:
        return ok(worker.get(f"/v1/workers/{wid}"))["trust"]

    def cycle(name: str) -> tuple:
        wid, worker = new_worker(api, provider, name)
        activate(api, wid, jid)
        _working(api, wid)
        for _ in range(25):  # probation (or, with a strike, suspect), honestly, until trusted
            send(worker, False)
            if trust(wid, worker) == "trusted":
                break
        assert trust(wid, worker) == "trusted"
        while trust(wid, worker) == "trusted":  # forge until an audit catches it
            send(worker, True)
        return wid, worker

    first, _ = cycle("machine-1")
    assert ok(provider.get(f"/v1/workers/{first}"))["trust"] == "suspect"
    assert provider.delete(f"/v1/workers/{first}").status_code == 204  # the struck machine "was decommissioned"
    fresh = ok(provider.post("/v1/workers", json={"name": "machine-2", "vram_gb": 16}), 201)["worker"]
    assert fresh["trust"] == "suspect" and "has 1 strike" in fresh["trust_reason"]
    assert provider.delete(f"/v1/workers/{fresh['id']}").status_code == 204
    second, worker2 = cycle("machine-3")  # a fresh machine: the strike it inherits is its first

    me = ok(provider.get("/v1/providers/me"))
    with api.db.session() as s:
        entries = s.scalars(select(LedgerEntry).where(LedgerEntry.provider_id == me["id"])).all()
        kept = {r for e in entries if e.kind == "worker" and e.clawed_back_by is None for r in e.rollout_ids}
        kept_usd = sum(e.amount_usd for e in entries if e.kind == "worker" and e.clawed_back_by is None)
    paid_forged = forged & kept
    assert trust(second, worker2) in ("quarantined", "banned") and not paid_forged, (
        f"two strikes of the provider's machines, the first deleted while suspect: the second machine is "
        f"{trust(second, worker2)}, provider watch_until={me['watch_until']}, and {len(paid_forged)} forged groups "
        f"(of {len(forged)}) stay paid; provider keeps ${kept_usd:.2f}")


def test_a_deleted_workers_strikes_pass_on_only_within_the_window_and_move_to_the_new_worker(api):
    from datetime import timedelta

    from api.models import Worker, utcnow
    from api.services.trust import INHERIT_DAYS

    _, provider = new_provider(api, "honest-gpu")

    def worker(name: str, strikes: int, status: str, last_beat_days_ago: float) -> str:
        wid, _ = new_worker(api, provider, name)
        with api.db.session() as s:
            w = s.get_one(Worker, wid)
            w.strikes, w.status, w.trust_reason = strikes, status, "failed its audit"
            w.last_heartbeat_at = utcnow() - timedelta(days=last_beat_days_ago)
            s.commit()
        return wid

    worker("left-long-ago", 1, "deregistered", INHERIT_DAYS + 1)
    fresh = ok(provider.post("/v1/workers", json={"name": "new", "vram_gb": 16}), 201)["worker"]
    assert fresh["trust"] == "probation"
    gone = worker("deleted-lately", 1, "deregistered", 1)
    fresh = ok(provider.post("/v1/workers", json={"name": "newer", "vram_gb": 16}), 201)["worker"]
    assert fresh["trust"] == "suspect" and fresh["trust_reason"].startswith(f"worker {gone} of its provider has")
    with api.db.session() as s:
        assert s.get_one(Worker, gone).strikes == 0 and s.get_one(Worker, fresh["id"]).inherited_from == gone


def test_spare_identities_registered_before_any_strike_cannot_each_forge_a_trust_cycle_unpunished(api, tmp_path):
    """Strikes passed only to workers registered after them: a provider that registered three identities up front
    spent a trust cycle of each forging until its first strike, none quarantined, its forged groups no audit picked
    kept paid (review finding). A provider's workers' strikes now add up where its audits fail too often for
    numerics (trust._struck_alongside)."""
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=64, max_steps=1000,
                               num_prompts=400, grpo={"group_size": 2, "prompts_per_step": 64})
    jid = job["id"]
    _, provider = new_provider(api, "mallory-gpu")
    # All registered at once, before anything is struck: none inherits anything.
    spares = [new_worker(api, provider, f"identity-{k}") for k in range(3)]
    forged: set[str] = set()
    state = {"step": 0}

    def send(worker, forge: bool) -> None:
        _one_group(api, worker, learner, jid, state["step"], forged, forge)
        state["step"] += 1

    def trust(wid) -> str:
        return ok(provider.get(f"/v1/workers/{wid}"))["trust"]

    for wid, worker in spares:
        _pass_probation(api, jid, wid, lambda w=worker: send(w, False), lambda w=wid: trust(w))
        while trust(wid) == "trusted":  # forge until an audit catches it
            send(worker, True)
        # the struck identity is put aside (kept registered and idle: it is never struck again)
        with api.db.session() as s:
            unassign(s, s.get_one(Worker, wid))
            s.commit()
        if any(trust(w) == "quarantined" for w, _ in spares):
            break

    me = ok(provider.get("/v1/providers/me"))
    states = {wid: trust(wid) for wid, _ in spares}
    with api.db.session() as s:
        entries = s.scalars(select(LedgerEntry).where(LedgerEntry.provider_id == me["id"])).all()
        kept = {r for e in entries if e.kind == "worker" and e.clawed_back_by is None for r in e.rollout_ids}
        kept_usd = sum(e.amount_usd for e in entries if e.kind == "worker" and e.clawed_back_by is None)
    paid_forged = forged & kept
    assert not paid_forged and any(st in ("quarantined", "banned") for st in states.values()), (
        f"one provider's identities, registered together before any strike, forged one trust cycle each: "
        f"{len(spares)} strikes in all and none quarantined ({states}), provider watch_until={me['watch_until']}; "
        f"{len(paid_forged)} of its {len(forged)} forged groups stay paid, and it keeps ${kept_usd:.2f}")


# What the learner's audit reports for a group whose tokens are a little too likely for sampling (picked among near
# ties, claiming bf16): the replay passes it (|z| < z_crit = 6), and the CUSUM over the worker's audits drifts.
BIASED = {"tokens": 6.0, "replayed": 6.0, "mismatches": 1.0, "near_ties": 0.0, "z": 4.0}
HONEST = {"tokens": 6.0, "replayed": 6.0, "mismatches": 0.0, "near_ties": 0.0, "z": 0.0}


def test_spare_identities_each_struck_once_by_the_sequential_tests_add_up_to_a_quarantine(api, tmp_path):
    """Attack 33 with a cheat that the sequential tests catch rather than one audit: three identities registered up
    front each pass probation honestly, then send biased groups (steering what is trained) until the CUSUM over
    their audits strikes them, and are parked. Three strikes of one provider, as in attack 33, but none of them a
    failed audit: the provider's failure share stayed 0 %, nobody was quarantined, and every biased group stayed
    trained and paid (review finding). A strike no failed audit explains now counts as a failed audit in the share."""
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=64, max_steps=10_000,
                               num_prompts=2000, grpo={"group_size": 2, "prompts_per_step": 64})
    jid = job["id"]
    _, provider = new_provider(api, "mallory-gpu")
    spares = [new_worker(api, provider, f"identity-{k}") for k in range(3)]
    biased: set[str] = set()
    state = {"step": 0}

    pending: list[str] = []

    def commit() -> None:  # the learner's step over the groups it claimed (audited early, as picked)
        if pending:
            ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(state["step"], list(pending))))
            pending.clear()
            state["step"] += 1
            _bill(api, 60.0)

    def send(worker, bias: bool) -> None:
        lease = ok(worker.post("/v1/leases", json={"job_id": jid, "max_prompts": 1, "version": 0}), 201)
        out = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts",
                             json={"groups": [_group(lease["prompts"][0], 0, finish="stop")]}))
        rid = out["results"][0]["rollout_id"]
        assert out["results"][0]["status"] == "accepted", out
        if bias:
            biased.add(rid)
        step = state["step"]
        claimed = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": step, "max_groups": 64}))["groups"]
        audits = [{"rollout_id": g["rollout_id"], "passed": True, "reason": None,
                   "stats": BIASED if g["rollout_id"] in biased else HONEST} for g in claimed if g["audit"]]
        if audits:
            ok(learner.post(f"/v1/jobs/{jid}/learner/audits", json={"step": step, "audits": audits}))
        pending.extend(g["rollout_id"] for g in claimed)
        if len(pending) >= 40:
            commit()

    def trust(wid) -> str:
        return ok(provider.get(f"/v1/workers/{wid}"))["trust"]

    for wid, worker in spares:
        _pass_probation(api, jid, wid, lambda w=worker: send(w, False), lambda w=wid: trust(w))
        for _ in range(200):  # biased until the sequential tests strike it
            send(worker, True)
            if trust(wid) != "trusted":
                break
        assert trust(wid) != "trusted"
        commit()
        with api.db.session() as s:  # parked: registered and idle, never struck again
            unassign(s, s.get_one(Worker, wid))
            s.commit()
        if any(trust(w) in ("quarantined", "banned") for w, _ in spares):
            break

    me = ok(provider.get("/v1/providers/me"))
    states = {wid: trust(wid) for wid, _ in spares}
    with api.db.session() as s:
        strikes = {w.id: (w.strikes, w.audits_failed, (w.trust_reason or '')[:70]) for w in
                   s.scalars(select(Worker).where(Worker.id.in_([wid for wid, _ in spares])))}
        entries = s.scalars(select(LedgerEntry).where(LedgerEntry.provider_id == me["id"])).all()
        kept = {r for e in entries if e.kind == "worker" and e.clawed_back_by is None for r in e.rollout_ids}
    paid_biased = biased & kept
    assert any(st in ("quarantined", "banned") for st in states.values()) and not paid_biased, (
        f"one provider's three identities were each struck by the sequential tests: {strikes} (strikes, failed "
        f"audits, reason); none quarantined ({states}), watch_until={me['watch_until']}; {len(paid_biased)} of "
        f"their {len(biased)} biased groups were trained and stay paid")


def _pass_probation(api, jid: str, wid: str, send_honest, trust) -> None:  # type: ignore[no-untyped-def]
    """The spare identity activated on the job sends honest groups until it is trusted."""
    activate(api, wid, jid)
    _working(api, wid)
    for _ in range(25):
        send_honest()
        if trust() == "trusted":
            return
    raise AssertionError(f"{wid} still {trust()} after 25 honest groups")
