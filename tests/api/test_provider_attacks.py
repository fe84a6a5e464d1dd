"""What a review of the provider side (registration, heartbeats, pay, quarantine and bans, what a provider reads)
found, as an honest and as a dishonest GPU provider would use it (docs/RELIABILITY.md, "Found by a review of the
provider side"): each test mounts one finding."""

from __future__ import annotations

from datetime import timedelta

import pytest
from echo2.protocol import TrustState
from sqlalchemy import select

from api.models import Job, Lease, LedgerEntry, Rollout, StepMetric, Worker, utcnow
from api.services.trust import release_quarantines
from scheduler import billing
from tests.api.test_trust import job_with_worker, one_step, trust_of
from tests.factories import (
    activate,
    fake_model_folder,
    group_body,
    hold,
    new_provider,
    new_user,
    new_worker,
    ok,
    publish,
    run_tick,
    running_job,
    step_report,
)


def _bill(api, seconds: float = 10.0) -> None:
    """One reconcile tick's billing, `seconds` after the last one."""
    now = utcnow()
    with api.db.session() as s:
        billing.bill(s, api.server.settings, now, (now - timedelta(seconds=seconds)).timestamp())
        s.commit()


def _working(api, wid: str, job_id: str | None) -> None:
    """The worker as the scheduler leaves it when it activates it (and as its heartbeat says): active on the job,
    at $3600/h (a dollar a second), activated for one group a second."""
    with api.db.session() as s:
        w = s.get_one(Worker, wid)
        w.status, w.price_per_hour, w.activated_mu = "active", 3600.0, 1.0
        if job_id is not None:
            w.job_id, w.desired = job_id, "active"
        s.commit()


def _worker_entries(api, wid: str) -> list[LedgerEntry]:
    with api.db.session() as s:
        return list(s.scalars(select(LedgerEntry).where(LedgerEntry.worker_id == wid, LedgerEntry.kind == "worker")))


# -- 1. pay for work forfeited at a quarantine, once the quarantine ends ------------------------------------------


def test_work_forfeited_at_a_quarantine_is_not_paid_once_the_quarantine_ends(api, tmp_path):
    """billing.bill: "A quarantined or banned worker forfeits what it has not been paid yet: it was caught
    cheating" (RELIABILITY: "unpaid rollouts forfeited"). The worker's unpaid groups and its unpaid active time were
    only skipped while it was quarantined: the tick after `release_quarantines` paid them all."""
    job, learner, wid, worker, _, _ = job_with_worker(api, tmp_path)
    _working(api, wid, job["id"])
    _bill(api, 10.0)  # ten seconds of active time, nothing trained yet: nothing paid, 10 s waiting
    one_step(api, job, learner, worker, [True, True], step=0)  # two groups trained, unpaid until the next tick
    one_step(api, job, learner, worker, [False, False], step=1)  # then two forged groups: quarantined
    assert trust_of(api, wid)["trust"] == "quarantined"
    _bill(api, 10.0)
    assert _worker_entries(api, wid) == []  # forfeited while quarantined, as documented
    with api.db.session() as s:  # the hour of quarantine passes
        s.get_one(Worker, wid).quarantined_until = utcnow() - timedelta(seconds=1)
        s.commit()
    with api.db.session() as s:
        assert release_quarantines(s, utcnow()) == 1
        s.commit()
    _bill(api, 10.0)  # the worker is idle now (unassigned): it earns nothing new this tick
    paid = _worker_entries(api, wid)
    assert paid == [], (f"paid ${sum(e.amount_usd for e in paid):.2f} after its quarantine for "
                        f"{sum(e.groups for e in paid)} groups it forfeited when it was caught forging")


# -- 2. a provider sheds a quarantine's consequence by replacing the worker ---------------------------------------


def test_a_provider_on_watch_cannot_shed_its_quarantine_by_replacing_the_worker(api, tmp_path):
    """A quarantined worker's next strike bans it and its provider (trust.strike). Its provider deletes it and
    registers a fresh machine instead, during the watch: the fresh worker started with no quarantine on record, so
    it forged twice more to be quarantined again, never banned; the provider could repeat this with every worker."""
    job, learner, wid, worker, provider, _ = job_with_worker(api, tmp_path)
    one_step(api, job, learner, worker, [False, False], step=0)
    assert trust_of(api, wid)["trust"] == "quarantined"
    assert ok(provider.get("/v1/providers/me"))["watch_until"] is not None
    assert provider.delete(f"/v1/workers/{wid}").status_code == 204
    fresh_id, fresh = new_worker(api, provider, "fresh")
    activate(api, fresh_id, job["id"])
    one_step(api, job, learner, fresh, [False], step=1)  # forging again, while the provider is on watch
    me = ok(provider.get("/v1/providers/me"))
    assert trust_of(api, fresh_id)["trust"] == "banned" and me["banned_at"] is not None, (
        f"a strike of the provider's replacement worker during its watch left it {trust_of(api, fresh_id)['trust']}"
        f" and the provider unbanned ({me['standing_reason']})")


# -- 3. a provider whose worker is quarantined or banned is never told so by the worker --------------------------


def _quarantined_worker(api, tmp_path):
    """A worker quarantined by its audits, and the provider's client."""
    job, learner, wid, worker, provider, _ = job_with_worker(api, tmp_path)
    one_step(api, job, learner, worker, [False, False], step=0)
    assert trust_of(api, wid)["trust"] == "quarantined"
    return wid, worker, provider


def test_the_worker_tells_its_operator_it_is_quarantined(api, tmp_path, caplog):
    """The heartbeat reply's `notice` is "something the worker's operator should read" (HeartbeatReply): why it
    may not work. `echo2-worker join`'s loop never showed it: a quarantined (or banned) worker sat idle, logging
    nothing, heartbeating for as long as it ran, and its operator could not tell it from a worker with no job."""
    import logging
    import threading
    import time

    from echo2_worker.control import ControlPlane
    from echo2_worker.loop import LoopOptions
    from echo2_worker.loop import Worker as WorkerLoop
    from echo2_worker.store import VersionStore

    wid, worker, _ = _quarantined_worker(api, tmp_path)
    token = worker.headers["authorization"].removeprefix("Bearer ")
    control = ControlPlane(api.url, token)

    def no_backend():
        raise AssertionError("a quarantined worker loads no model")

    loop = WorkerLoop(LoopOptions(worker_id=wid, data_dir=tmp_path / "data", heartbeat_interval_s=0.5), control,
                      no_backend, VersionStore(tmp_path / "data" / "versions"))
    with caplog.at_level(logging.INFO):
        thread = threading.Thread(target=loop.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while (loop.heartbeats.latest() is None or time.monotonic() < deadline - 7) and time.monotonic() < deadline:
            time.sleep(0.1)  # three seconds of the loop, several beats
        notice = (loop.heartbeats.latest().notice or "") if loop.heartbeats.latest() else ""
        loop.request_drain()
        thread.join(20)
        control.close()
    assert "quarantined" in notice  # the control plane says it ...
    said = [r.getMessage() for r in caplog.records if r.name.startswith("echo2_worker")]
    assert any("quarantined" in line for line in said), f"... the worker never tells its operator: {said}"


def test_echo2_worker_status_says_the_worker_is_quarantined_and_why(api, tmp_path, capsys):
    """`echo2-worker status` is where a provider looks when its worker earns nothing ("why it works where it
    does, or stays idle", README). For a quarantined worker it printed its status, job, version and counts, and
    not its trust state or the reason, which the control plane returns in the same answer (`trust`,
    `trust_reason`, `quarantined_until`)."""
    from echo2_worker import cli
    from echo2_worker.config import CredentialStore, SavedWorker

    wid, worker, _ = _quarantined_worker(api, tmp_path)
    token = worker.headers["authorization"].removeprefix("Bearer ")
    config = tmp_path / "config"
    CredentialStore(config).save(SavedWorker(server=api.url, worker_id=wid, worker_token=token, name="w"))
    assert cli.main(["--config-dir", str(config), "status", "--server", api.url]) == 0
    out = capsys.readouterr().out
    assert wid in out
    assert "quarantined" in out, f"`echo2-worker status` of a quarantined worker:\n{out}"


# -- 4. one tenant's job pays for the time a worker spent on another's -------------------------------------------


def test_a_job_is_charged_only_for_the_time_the_worker_was_active_on_it(api, tmp_path):
    """A worker's unpaid active time was one pot (`Worker.unbilled_s`) whatever job it was active on, and it stayed
    when the scheduler moved the worker: Alice's job, on which the worker idled for five minutes, paid nothing, and
    the first groups the worker then delivered for Bob's job bought those minutes at Bob's expense."""
    from tests.factories import fake_model_folder, new_user, running_job

    job_a, _, wid, worker, _, _ = job_with_worker(api, tmp_path)  # Alice's job
    _, bob = new_user(api, "bob")
    job_b, learner_b = running_job(api, bob, fake_model_folder(tmp_path / "b"), staleness=2, max_steps=50,
                                   num_prompts=200, grpo={"group_size": 2, "prompts_per_step": 64})
    _working(api, wid, job_a["id"])
    for _ in range(15):  # five minutes on Alice's job, nothing delivered there
        _bill(api, 20.0)
    activate(api, wid, job_b["id"])  # the scheduler moves it to Bob's job
    _working(api, wid, job_b["id"])
    one_step(api, job_b, learner_b, worker, [True] * 8, step=0)  # 8 groups for Bob, trained at once
    _bill(api, 2.0)  # two seconds of active time on Bob's job
    with api.db.session() as s:
        on_b = list(s.scalars(select(LedgerEntry).where(LedgerEntry.job_id == job_b["id"],
                                                        LedgerEntry.kind == "worker")))
    charged = sum(e.seconds for e in on_b)
    assert charged <= 2.0 + 1e-6, (f"Bob's job was charged {charged:.0f} s of the worker's time (${charged:.2f}) "
                                   f"for the 2 s it was active on it: {[e.memo for e in on_b]}")


# -- 5. a worker registered while its provider is being banned works on ------------------------------------------


def test_a_worker_registered_while_its_provider_is_banned_is_banned_with_it(api, tmp_path):
    """trust.ban bans the provider and every worker of it that it finds; fleet.register_worker read `banned_at`
    without the provider's lock. A provider that kept registering workers while one of its workers was being banned
    (its forged group being judged) got a worker past the ban: registered in good standing, under a banned
    provider, free to lease. (PostgreSQL, where the two transactions run side by side.)"""
    import threading
    import time

    from api.services import trust

    if not api.db.is_postgres:
        pytest.skip("SQLite runs one writer at a time")
    job, learner, wid, worker, provider, _ = job_with_worker(api, tmp_path)
    answer: list = []
    with api.db.session() as s:
        w = s.get_one(Worker, wid, with_for_update=True)
        w.quarantines = 1  # quarantined before: this strike bans it, and its provider
        trust.strike(s, w, "failed its audit: forged", api.server.settings)
        s.flush()  # the ban is written, not yet committed: the learner's request is still at work
        late = threading.Thread(target=lambda: answer.append(
            provider.post("/v1/workers", json={"name": "late", "vram_gb": 16})), daemon=True)
        late.start()
        time.sleep(1.0)
        s.commit()
    late.join(30)
    assert ok(provider.get("/v1/providers/me"))["banned_at"] is not None
    r = answer[0]  # it waited for the ban's commit, then read it
    assert r.status_code == 403 and "this provider is banned" in r.json()["detail"], r.text


def test_an_honest_providers_other_machine_restarted_during_a_watch_is_not_banned_by_one_strike(api, tmp_path):
    """The rule above bans a worker registered during a watch only while a worker of the provider was deleted in
    quarantine (the replacement pattern): an honest provider's other machine that rejoined meanwhile, struck once
    (on probation every group is audited), is a suspect, as any worker with one strike is."""
    job, learner, wid, worker, provider, _ = job_with_worker(api, tmp_path)
    one_step(api, job, learner, worker, [False, False], step=0)
    assert trust_of(api, wid)["trust"] == "quarantined"  # kept, not deleted: it serves its quarantine
    other_id, other = new_worker(api, provider, "other-machine")  # rejoined after a crash, during the watch
    activate(api, other_id, job["id"])
    one_step(api, job, learner, other, [False], step=1)
    assert trust_of(api, other_id)["trust"] == "suspect"
    assert ok(provider.get("/v1/providers/me"))["banned_at"] is None


def _hoarder_and_honest(api, tmp_path):
    """A job (R = 8, S = 2) with two trusted workers on it, Mallory's and Bob's; Mallory has delivered one honest
    step's groups (measured: its trial never fails again), and both hold version 1. Returns (job id, its owner,
    Mallory's id and client, Bob's id and client, Mallory's first lease)."""
    folder = fake_model_folder(tmp_path / "m")
    _, alice = new_user(api)
    job, learner = running_job(api, alice, folder, staleness=2, max_steps=1000, num_prompts=400,
                               grpo={"group_size": 2, "prompts_per_step": 8})
    jid = job["id"]
    mid, mallory = new_worker(api, new_provider(api, "mallory-co")[1], "m", rollouts_per_s=1.0)
    bid, bob = new_worker(api, new_provider(api, "honest-co")[1], "b", rollouts_per_s=1.0)
    with api.db.session() as s:
        for w in (mid, bid):
            s.get_one(Worker, w).trust = "trusted"
        s.commit()
    for w in (mid, bid):
        activate(api, w, jid)
    # Mallory delivers one honest step's batch.
    lease = ok(mallory.post("/v1/leases", json={"job_id": jid, "max_prompts": 8, "version": 0}), 201)
    ok(mallory.post(f"/v1/leases/{lease['id']}/rollouts",
                    json={"groups": [group_body(p, 0) for p in lease["prompts"]]}))
    claimed = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 0, "max_groups": 8}))["groups"]
    audits = [{"rollout_id": g["rollout_id"], "passed": True, "reason": None, "stats": {"tokens": 6.0}}
              for g in claimed if g["audit"]]
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(
        0, [g["rollout_id"] for g in claimed], audits=audits, t_train_s=30.0)))
    publish(learner, jid, folder, version=1, step=1)
    hold(mallory, 0, 1)
    hold(bob, 0, 1)
    return jid, alice, mid, mallory, bid, bob, lease


def _an_hour_on(api, jid: str, mid: str, bid: str, first_lease: str, hoard: str, hoard_age: timedelta):
    """The scheduler's view an hour after Mallory's honest step: both workers active, Mallory's groups and first
    lease an hour old, its hoard leased `hoard_age` ago (renewed every TTL since). Returns now."""
    now = utcnow()
    with api.db.session() as s:
        for w in (mid, bid):
            row = s.get_one(Worker, w)
            row.active_since, row.status, row.last_heartbeat_at = now - timedelta(hours=1), "active", now
        for r in s.scalars(select(Rollout).where(Rollout.worker_id == mid)):
            r.created_at = now - timedelta(minutes=59)
        s.get_one(Lease, first_lease).created_at = now - timedelta(minutes=59, seconds=30)
        s.get_one(Lease, hoard).created_at = now - hoard_age
        j = s.get_one(Job, jid)
        j.learner_launched_at = j.learner_heartbeat_at = now
        s.commit()
    return now


def test_a_trusted_worker_holding_all_lease_room_cannot_lock_every_other_provider_out(api, tmp_path):
    """A trusted worker that delivered one honest step (measured) leased every prompt the job could lease and only
    renewed: an hour on, the scheduler kept it on the job, every other worker was refused "no room", and the job had
    not stepped (review finding). A worker that holds prompts idle past lease_idle_s is renewed no lease, and is
    measured at zero (deactivated) as a trial that delivered nothing is."""
    jid, alice, mid, mallory, bid, bob, lease = _hoarder_and_honest(api, tmp_path)

    # Then it takes every prompt the job can lease at version 1, and only renews.
    hoard = ok(mallory.post("/v1/leases", json={"job_id": jid, "max_prompts": 256, "version": 1}), 201)
    refused = bob.post("/v1/leases", json={"job_id": jid, "max_prompts": 8, "version": 1})
    assert refused.status_code == 409 and "no room" in refused.text, refused.text

    # An hour on: Mallory renewed every TTL and sent nothing more; Bob asked, refused.
    now = _an_hour_on(api, jid, mid, bid, lease["id"], hoard["id"], timedelta(minutes=58))
    refused = mallory.post(f"/v1/leases/{hoard['id']}/renew")
    assert refused.status_code == 409 and "held prompts for" in refused.text, refused.text
    run_tick(api, now=now)

    with api.db.session() as s:
        m, b = s.get_one(Worker, mid), s.get_one(Worker, bid)
        m_job, b_job = m.job_id, b.job_id
        hoard_status = s.get_one(Lease, hoard["id"]).status
    again = bob.post("/v1/leases", json={"job_id": jid, "max_prompts": 8, "version": 1})
    step = ok(alice.get(f"/v1/jobs/{jid}"))["step"]
    why = ok(api.admin.get(f"/v1/workers/{mid}/placement"))[0]["line"]
    assert not (m_job == jid and hoard_status == "active" and again.status_code == 409), (
        f"an hour after it last delivered, Mallory's worker is still on Alice's job ({m_job == jid}) holding "
        f"{len(hoard['prompts'])} prompts ({hoard_status}), every prompt the job can lease; Bob's worker, on the job "
        f"too ({b_job == jid}), is refused again: {again.status_code} {again.json()['detail'][:90]}...; "
        f"the job is still at step {step}; the scheduler's line on Mallory: {why!r}")


def test_a_job_that_caps_its_price_per_group_is_not_given_a_worker_that_costs_more(api, tmp_path):
    """A job short of workers is given every qualifying one, whatever it costs a group: a fast machine that claimed a
    tenth of its speed at the same hourly price was activated beside an honest one and paid 10x a group (review
    finding). Its owner caps that (workers.max_usd_per_group): such a worker is not activated, and says why."""
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=8, max_steps=1000, num_prompts=400,
                         grpo={"group_size": 2, "prompts_per_step": 64}, workers={"max_usd_per_group": 2.0})
    hid, honest = new_worker(api, new_provider(api, "honest-co")[1], "honest", price_per_hour=3600.0,
                             rollouts_per_s=1.0)  # $1 a group
    mid, mallory = new_worker(api, new_provider(api, "mallory-co")[1], "m", price_per_hour=3600.0,
                              rollouts_per_s=0.1)  # $10 a group
    for wid, client in ((hid, honest), (mid, mallory)):
        ok(client.post(f"/v1/workers/{wid}/heartbeat", json={"status": "idle", "versions_held": [0]}))
    with api.db.session() as s:
        j = s.get_one(Job, job["id"])
        j.learner_launched_at = j.learner_heartbeat_at = utcnow()  # launched, as the tick would have
        s.commit()
    run_tick(api)
    assert ok(api.admin.get(f"/v1/workers/{hid}"))["job_id"] == job["id"]
    assert ok(api.admin.get(f"/v1/workers/{mid}"))["job_id"] is None
    line = ok(api.admin.get(f"/v1/workers/{mid}/placement"))[0]["line"]
    assert "$10 a group ($3600/h at 0.1 groups/s) > the job's workers.max_usd_per_group $2" in line, line


def test_an_honest_worker_whose_claim_is_well_under_the_cap_is_activated_on_trial(api, tmp_path):
    """A worker on trial counts for at most trial_share of a job's need: the cap judged it at that rate (0.07
    groups/s: "$13.6 a group") instead of its claim ($1 a group), so no new worker was ever activated on a capped
    small job (review finding)."""
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=8, max_steps=1000, num_prompts=400,
                         grpo={"group_size": 2, "prompts_per_step": 8}, workers={"max_usd_per_group": 2.0})
    hid, honest = new_worker(api, new_provider(api, "honest-co")[1], "honest", price_per_hour=3600.0,
                             rollouts_per_s=1.0)  # $1 a group by its claim
    ok(honest.post(f"/v1/workers/{hid}/heartbeat", json={"status": "idle", "versions_held": [0]}))
    with api.db.session() as s:
        j = s.get_one(Job, job["id"])
        j.learner_launched_at = j.learner_heartbeat_at = utcnow()
        for k in range(3):  # the job's learner has stepped: 30 s a step
            s.add(StepMetric(job_id=job["id"], step=k, t_train_s=30.0, groups=8, groups_dropped=0,
                             staleness_hist=[], tokens=100))
        s.commit()
    run_tick(api)
    line = ok(api.admin.get(f"/v1/workers/{hid}/placement"))[0]["line"]
    assert ok(api.admin.get(f"/v1/workers/{hid}"))["job_id"] == job["id"], line


def test_a_hoarder_that_releases_and_leases_again_before_lease_idle_s_still_locks_everyone_out(api, tmp_path):
    """Attack 34 with one change: the hoarder releases its lease every 9 minutes and leases every prompt again at
    once, and the idle clock, a lease's own, started anew (review finding). It counts the leases held one after
    another now."""
    jid, alice, mid, mallory, bid, bob, lease = _hoarder_and_honest(api, tmp_path)
    hoard = ok(mallory.post("/v1/leases", json={"job_id": jid, "max_prompts": 256, "version": 1}), 201)
    # An hour on; the latest hoard was leased 9 minutes ago (the one before it released).
    now = _an_hour_on(api, jid, mid, bid, lease["id"], hoard["id"], timedelta(minutes=9))
    ok(mallory.post(f"/v1/leases/{hoard['id']}/release"))
    again = mallory.post("/v1/leases", json={"job_id": jid, "max_prompts": 256, "version": 1})
    assert again.status_code == 409 and "held prompts for" in again.text, again.text
    run_tick(api, now=now)
    assert ok(api.admin.get(f"/v1/workers/{mid}"))["job_id"] is None  # measured at zero: deactivated
    with api.db.session() as s:  # and the room it held is free for the others
        assert not s.scalars(select(Lease).where(Lease.worker_id == mid, Lease.status == "active")).all()


def test_an_honest_worker_whose_lease_takes_over_lease_idle_s_to_generate_is_not_cut_off(api, tmp_path):
    """The shipped worker generates a whole lease in one backend call and books its next lease before it starts, so
    its prefetched lease gets its first group about two lease generations after its grant: a CPU worker taking 5.5
    minutes a lease had every prefetched lease ended at 10 minutes and was measured at zero (review finding). A
    lease may go IDLE_PATIENCE times its generation at the worker's own pace (its groups' gen_seconds)."""
    jid, alice, mid, mallory, bid, bob, _ = _hoarder_and_honest(api, tmp_path)
    first = ok(bob.post("/v1/leases", json={"job_id": jid, "max_prompts": 8, "version": 1}), 201)
    slow = [{**group_body(p, 1), "gen_seconds": 41.0} for p in first["prompts"]]  # 5.5 minutes for its 8
    ok(bob.post(f"/v1/leases/{first['id']}/rollouts", json={"groups": slow}))
    lease = ok(bob.post("/v1/leases", json={"job_id": jid, "max_prompts": 8, "version": 1}), 201)
    with api.db.session() as s:  # granted 11 minutes ago, renewed every TTL since; generation still running
        s.get_one(Lease, first["id"]).created_at = utcnow() - timedelta(minutes=6)  # its groups came 5.5 min on
        s.get_one(Lease, lease["id"]).created_at = utcnow() - timedelta(minutes=11)
        s.commit()
    renewed = bob.post(f"/v1/leases/{lease['id']}/renew")
    with api.db.session() as s:
        failed_at = s.get_one(Worker, bid).trial_failed_at
    assert renewed.status_code == 200 and failed_at is None, (
        f"{renewed.status_code} {renewed.text[:200]}; its worker measured at zero (trial_failed_at={failed_at})")
    sent = bob.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group_body(p, 1) for p in lease["prompts"]]})
    assert all(r["status"] == "accepted" for r in ok(sent)["results"]), sent.text


def test_late_junk_groups_claiming_a_days_generation_do_not_let_a_hoarder_hold_every_prompt(api, tmp_path):
    """Attack 34 again, with one cheap step first (review finding): the hoarder leases 8 prompts, releases the lease,
    and sends 8 junk groups on it (no model run) claiming gen_seconds 86,400. They are refused as `lease_ended`
    (blameless: no strike, no audit, no pay), so the scheduler's T_gen (groups worth something only) still sees a
    fast worker; but the idle rule averaged the gen_seconds of every group of the worker, these too, and let it
    hold 256 prompts idle for 3 x 256 x ~43,000 s. It then leased every prompt the job can lease and only renewed,
    as in attack 34. Only delivered groups count now, each for at most as long as its lease had been held."""
    jid, alice, mid, mallory, bid, bob, lease = _hoarder_and_honest(api, tmp_path)

    decoy = ok(mallory.post("/v1/leases", json={"job_id": jid, "max_prompts": 8, "version": 1}), 201)
    ok(mallory.post(f"/v1/leases/{decoy['id']}/release"))
    junk = [{**group_body(p, 1), "gen_seconds": 86_400.0} for p in decoy["prompts"]]
    late = ok(mallory.post(f"/v1/leases/{decoy['id']}/rollouts", json={"groups": junk}))["results"]
    assert all(r["status"] == "rejected" and r["reason"] == "lease is released" for r in late), late
    with api.db.session() as s:
        assert s.get_one(Worker, mid).strikes == 0  # blameless

    hoard = ok(mallory.post("/v1/leases", json={"job_id": jid, "max_prompts": 256, "version": 1}), 201)
    refused = bob.post("/v1/leases", json={"job_id": jid, "max_prompts": 8, "version": 1})
    assert refused.status_code == 409 and "no room" in refused.text, refused.text

    # An hour on (attack 34's clock): Mallory renewed every TTL and sent nothing more; Bob asked, refused.
    now = _an_hour_on(api, jid, mid, bid, lease["id"], hoard["id"], timedelta(minutes=58))
    with api.db.session() as s:
        s.get_one(Lease, decoy["id"]).created_at = now - timedelta(minutes=59, seconds=10)
        s.get_one(Lease, decoy["id"]).finished_at = now - timedelta(minutes=59, seconds=5)
        s.commit()
    renewed = mallory.post(f"/v1/leases/{hoard['id']}/renew")
    run_tick(api, now=now)

    with api.db.session() as s:
        m = s.get_one(Worker, mid)
        m_job, m_strikes = m.job_id, m.strikes
        hoard_status = s.get_one(Lease, hoard["id"]).status
        mallory_groups = len(s.scalars(select(Rollout.id).where(Rollout.worker_id == mid)).all())
    again = bob.post("/v1/leases", json={"job_id": jid, "max_prompts": 8, "version": 1})
    step = ok(alice.get(f"/v1/jobs/{jid}"))["step"]
    assert not (renewed.status_code == 200 and m_job == jid and hoard_status == "active"
                and again.status_code == 409), (
        f"58 minutes idle, Mallory's hoard of {len(hoard['prompts'])} prompts was renewed ({renewed.status_code}); "
        f"the scheduler keeps it on Alice's job ({m_job == jid}), strikes {m_strikes}, {mallory_groups} groups sent "
        f"in all (8 of them late junk); Bob is refused again: {again.status_code} {again.text[:90]}; "
        f"the job is at step {step}")


def test_a_small_prefetched_lease_is_not_ended_while_the_worker_generates_the_big_one_before_it(api, tmp_path):
    """(Review finding.) A slow honest worker (its groups take 90 s each, as its reported gen_seconds say) generates
    its leases whole, 8 prompts in one backend call (12 minutes), and books its next lease as it starts each one
    (echo2_worker/loop.py: `prefetch`). Near a step's end the job had room for only 2 more prompts, so the
    prefetched lease B holds 2. 650 s into generating lease A, the worker renews both leases: A was renewed (its
    bound is 3 x 8 x 90 s), but B, which waits behind A exactly as the shipped worker makes it wait, was ended as
    idle and the worker is measured at zero (`trial_failed_at`: deactivated, A's 650 s of generation lost). The idle
    time counted for B is A's generation (the chain of leases held one after another), but its bound was B's own 2
    prompts (3 x 2 x 90 s, under lease_idle_s): the bound covers the prompts all the worker's leases hold now."""
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), grpo={"group_size": 2, "prompts_per_step": 9})
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider, "slow-gpu", rollouts_per_s=1 / 90)
    activate(api, wid, job["id"])
    with api.db.session() as s:  # past probation long ago
        s.get_one(Worker, wid).trust = TrustState.trusted
        s.commit()

    def lease() -> dict:
        return ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 8, "version": 0}), 201)

    z = lease()  # an earlier lease, delivered: 8 groups at 90 s each
    groups = [{**group_body(p, 0), "gen_seconds": 90.0} for p in z["prompts"]]
    ok(worker.post(f"/v1/leases/{z['id']}/rollouts", json={"groups": groups}))
    a = lease()  # generated now, whole
    b = lease()  # booked as A's generation started: the job had room for 2 more prompts
    assert len(a["prompts"]) == 8 and len(b["prompts"]) == 2, (len(a["prompts"]), len(b["prompts"]))
    now = utcnow()
    with api.db.session() as s:  # Z delivered 655 s ago; A and B granted right after; A generating since
        s.get_one(Lease, z["id"]).created_at = now - timedelta(seconds=1400)
        for r in s.scalars(select(Rollout).where(Rollout.lease_id == z["id"])):
            r.created_at = now - timedelta(seconds=655)
        s.get_one(Lease, a["id"]).created_at = now - timedelta(seconds=654)
        s.get_one(Lease, b["id"]).created_at = now - timedelta(seconds=653)
        s.commit()

    ok(worker.post(f"/v1/leases/{a['id']}/renew"))  # within its bound: 8 groups at 90 s take 720 s
    renewed = worker.post(f"/v1/leases/{b['id']}/renew")
    with api.db.session() as s:
        failed = s.get_one(Worker, wid).trial_failed_at
    assert renewed.status_code == 200 and failed is None, (
        f"the prefetched 2-prompt lease of an honest worker 650 s into generating its 8-prompt lease (720 s of work "
        f"at its pace) was refused: {renewed.status_code} {renewed.text[:200]}; the worker is measured at zero "
        f"(trial_failed_at={failed})")


def test_a_worker_that_claims_a_huge_rate_to_pass_the_price_cap_is_not_paid_many_times_the_cap_a_group(api, tmp_path):
    """Alice caps her job at $2 a group. Mallory registers at $3600/h claiming 1,000 groups/s: $0.000001 a group by its
    claim, so the cap lets it in on trial, and the scheduler activates it for the trial's share of the need (1/4 of
    the need, 0.073 groups/s). Its pay is measured against that share: each trained group buys 1 / (0.5 x 0.073) =
    27 s of its price. It sent one group near the end of its grace period and was paid $27 for it, 13 times the cap
    Alice set (review finding). A group is paid at most the cap now (billing._capped)."""
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=8, max_steps=1000,
                               num_prompts=400, grpo={"group_size": 2, "prompts_per_step": 8},
                               workers={"max_usd_per_group": 2.0})
    jid = job["id"]
    mid, mallory = new_worker(api, new_provider(api, "mallory-co")[1], "m", price_per_hour=3600.0,
                              rollouts_per_s=1000.0)
    ok(mallory.post(f"/v1/workers/{mid}/heartbeat", json={"status": "idle", "versions_held": [0]}))
    with api.db.session() as s:
        j = s.get_one(Job, jid)
        j.learner_launched_at = j.learner_heartbeat_at = utcnow()
        for k in range(3):  # the job's learner has stepped: 30 s a step
            s.add(StepMetric(job_id=jid, step=900 + k, t_train_s=30.0, groups=8, groups_dropped=0,
                             staleness_hist=[], tokens=100))
        s.commit()
    run_tick(api)
    with api.db.session() as s:
        w = s.get_one(Worker, mid)
        assert w.job_id == jid, "activated on trial: its claim is far under the cap"
        activated_mu = w.activated_mu
    ok(mallory.post(f"/v1/workers/{mid}/heartbeat", json={"status": "active", "versions_held": [0]}))

    # 110 s of active time (the ticks' billing), delivering nothing yet: within its 120 s grace.
    now = utcnow()
    for k in range(11):
        with api.db.session() as s:
            at = now + timedelta(seconds=10 * (k + 1))
            billing.bill(s, api.server.settings, at, (at - timedelta(seconds=10)).timestamp())
            s.commit()

    # Then one honest group, trained.
    lease = ok(mallory.post("/v1/leases", json={"job_id": jid, "max_prompts": 1, "version": 0}), 201)
    rid = ok(mallory.post(f"/v1/leases/{lease['id']}/rollouts",
                          json={"groups": [group_body(lease["prompts"][0], 0)]}))["results"][0]["rollout_id"]
    claimed = ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 0, "max_groups": 8}))["groups"]
    audits = [{"rollout_id": g["rollout_id"], "passed": True, "reason": None, "stats": {"tokens": 6.0}}
              for g in claimed if g["audit"]]
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(0, [rid], audits=audits, t_train_s=30.0)))
    with api.db.session() as s:
        at = now + timedelta(seconds=120)
        billing.bill(s, api.server.settings, at, (at - timedelta(seconds=10)).timestamp())
        s.commit()

    with api.db.session() as s:
        paid = list(s.scalars(select(LedgerEntry).where(LedgerEntry.worker_id == mid, LedgerEntry.kind == "worker")))
    usd, groups = sum(e.amount_usd for e in paid), sum(e.groups for e in paid)
    assert groups == 1, paid
    assert usd / groups <= 2.0 + 1e-9, (
        f"Alice capped her job at $2 a group; Mallory's worker, let in on its claim of 1000 groups/s and activated "
        f"for {activated_mu:.3g} groups/s (the trial's share), was paid ${usd:.2f} for its {groups} group "
        f"({[e.memo for e in paid]})")
