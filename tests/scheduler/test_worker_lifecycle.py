"""What a review of the worker life cycle found, as a GPU provider whose machines misbehave honestly (they lose
the network, restart, run a second process) and as the scheduler's adversary (docs/RELIABILITY.md, "Found by a
review of the worker life cycle"): each test mounts one finding."""

from __future__ import annotations

import threading
from datetime import timedelta

import httpx
import pytest
from sqlalchemy import select

from api.models import Lease, Rollout, Worker, utcnow
from api.settings import Settings
from tests.factories import (
    activate,
    fake_model_folder,
    group_body,
    new_provider,
    new_user,
    new_worker,
    ok,
    running_job,
    submit_group,
)

# -- a short loss of the network silences a worker for longer than the offline threshold ------------------


class _VirtualClock:
    """Stands in for the `time` module of echo2.transport and for the heartbeat thread's waits: no real
    seconds pass, and every wait is recorded on one clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1.7e9 + self.now


class _ClockEvent:
    """`Heartbeats._now`: waiting advances the virtual clock instead of blocking."""

    def __init__(self, clock: _VirtualClock) -> None:
        self.clock = clock

    def wait(self, timeout: float | None = None) -> bool:
        self.clock.sleep(timeout or 0.0)
        return False

    def set(self) -> None:
        pass

    def clear(self) -> None:
        pass


class _ClockStop:
    def __init__(self, clock: _VirtualClock, until: float) -> None:
        self.clock, self.until = clock, until

    def is_set(self) -> bool:
        return self.clock.now >= self.until

    def set(self) -> None:
        self.until = -1.0


class _NoVersions:
    def holdings(self):  # type: ignore[no-untyped-def]
        return None, []

    def prove(self, job_id, challenges):  # type: ignore[no-untyped-def]
        return []

    def take_fetched(self):  # type: ignore[no-untyped-def]
        return []


def test_a_network_loss_shorter_than_the_offline_threshold_does_not_silence_the_worker_past_it(monkeypatch):
    """The control plane is unreachable for 12 s (an API restart, a provider's router rebooting), less than
    `worker_offline_after_s` (15 s) by more than a heartbeat interval. The worker's heartbeat thread backed off
    exponentially up to 30 s between tries (on top of the transport's own three retries), so its next beat after
    a 13 s outage came 16-21 s after its last one: the scheduler's next tick marked it offline, released its
    leases and the groups it was generating were refused ("lease is released"), unpaid. A failed beat is now
    tried again at the beat's own pace: an outage shorter than the threshold less an interval never reads as
    death."""
    import echo2.transport as transport
    from echo2.protocol import DesiredState, HeartbeatReply
    from echo2_worker.control import ControlPlane
    from echo2_worker.heartbeat import BadSources, Heartbeats
    from echo2_worker.progress import Stats

    offline_after = Settings().worker_offline_after_s
    interval = Settings().heartbeat_interval_s
    outage = (1.0, offline_after - interval)  # 12 s: the threshold less an interval, less the second before it
    clock = _VirtualClock()
    monkeypatch.setattr(transport, "time", clock)
    beats: list[float] = [0.0]  # the last beat before the outage went through at t = 0

    def server(request: httpx.Request) -> httpx.Response:
        if outage[0] <= clock.now < outage[1]:
            raise httpx.ConnectError("connection refused", request=request)
        beats.append(clock.now)
        reply = HeartbeatReply(desired=DesiredState.idle, heartbeat_interval_s=interval, server_time=utcnow())
        return httpx.Response(200, content=reply.model_dump_json(), headers={"content-type": "application/json"})

    control = ControlPlane("http://control-plane.test", "e2w_token")
    control._http.http = httpx.Client(base_url="http://control-plane.test", transport=httpx.MockTransport(server))
    hb = Heartbeats(control, "wrk_1", interval, _NoVersions(), Stats(), BadSources(),  # type: ignore[arg-type]
                    on_reply=lambda: None, on_gone=lambda exc: None)
    hb._now = _ClockEvent(clock)  # type: ignore[assignment]
    hb._stop = _ClockStop(clock, until=interval + 60.0)  # type: ignore[assignment]
    clock.now = interval  # the first beat of the loop is due an interval after the last one
    hb._run()

    after = [t for t in beats if t >= outage[1]]
    assert after, "no beat went through after the outage"
    silence = after[0] - max(t for t in beats if t < outage[0])
    assert silence < offline_after, (
        f"an outage of {outage[1] - outage[0]:.0f} s left the worker silent for {silence:.1f} s; the scheduler marks "
        f"a worker offline after {offline_after:.0f} s (its leases released, its work in flight refused)")


# -- an honest worker's trial is failed for the learner's slowness -----------------------------------------


def test_a_worker_refused_every_lease_for_lack_of_room_does_not_fail_its_trial(api, tmp_path):
    """A worker activated while the job's queue is full (the learner is relaunching, or slow: what is queued
    and leased already covers what it can train before the version goes stale) is answered 409 "no room" on
    every lease. After `delivery_grace_s` (120 s) with nothing delivered its trial is failed: measured at zero,
    deactivated, and not activated again for ten grace periods (20 minutes), though it was never allowed to
    deliver anything. Only a worker held back by its own audits (pool.held_back) is spared; a worker refused
    for the platform's reasons should be too."""
    from scheduler.reconcile import _worker_profile

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=1,
                         grpo={"group_size": 2, "prompts_per_step": 4})
    _, provider = new_provider(api)
    (first_id, first), (late_id, late) = [new_worker(api, provider, name) for name in ("first", "late")]
    activate(api, first_id, job["id"])
    lease = ok(first.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 8, "version": 0}), 201)
    for prompt in lease["prompts"]:  # (S + 1) R = 8 groups queued: all the learner can train before v0 is stale
        ok(submit_group(first, lease, prompt, 0))
    activate(api, late_id, job["id"])
    refused = late.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0})
    assert refused.status_code == 409 and "no room" in refused.json()["detail"]
    with api.db.session() as s:  # the learner has not stepped for 200 s; the late worker waited all along
        row = s.get_one(Worker, late_id)
        row.active_since = utcnow() - timedelta(seconds=200)
        s.commit()
        profile = _worker_profile(s, row, utcnow(), [], api.server.settings)
        assert row.trial_failed_at is None and profile.mu > 0, (
            "a worker the control plane refused every lease (no room: the learner is behind) failed its trial "
            "and is barred for 20 minutes")


# -- a second `echo2-worker join` with the same credentials -------------------------------------------------


def _registration(relay_port: int):  # type: ignore[no-untyped-def]
    from echo2.protocol import WorkerRegister

    return WorkerRegister(name="gpu-box", vram_gb=16, price_per_hour=0.5,
                          relay_url=f"http://127.0.0.1:{relay_port}", backends=["transformers"])


def test_a_second_join_does_not_deregister_the_worker_the_first_is_running(api, tmp_path):
    """`echo2-worker join` started twice on one machine (one config dir): the first holds relay port 7460, so
    the second fell back to a free port, found its registration "changed" (relay_url differs) and deregistered
    the saved worker, which the first process was running that very moment: its leases released (its groups in
    flight refused), its token revoked, and it exited. Now the second join sees that the saved worker is alive
    and refuses, saying why and what to do."""
    from echo2_worker.cli import _register_or_reuse
    from echo2_worker.config import CredentialStore, SavedWorker
    from echo2_worker.control import ControlPlane

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    provider_token = ok(api.admin.post("/v1/providers", json={"name": "gpu-co"}), 201)["token"]
    creds = CredentialStore(tmp_path / "config")

    first = ControlPlane(api.url)
    saved = SavedWorker(server=api.url, provider_token=provider_token)
    body = _registration(7460)
    wid, token, _ = _register_or_reuse(first, creds, saved, body, provider_token, False)
    saved.worker_id, saved.worker_token, saved.registration = wid, token, body.model_dump(mode="json")
    creds.save(saved)  # as `join` does
    worker = api.client(token)
    ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={"status": "active"}))
    activate(api, wid, job["id"])
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 2, "version": 0}), 201)

    beating = threading.Event()

    def first_process_beats() -> None:  # the first join's heartbeat thread, every half second
        while not beating.wait(0.5):
            worker.post(f"/v1/workers/{wid}/heartbeat", json={"status": "active"})

    beats = threading.Thread(target=first_process_beats, daemon=True)
    beats.start()
    second = ControlPlane(api.url)  # 7460 is taken by the first process's relay: a free port instead
    try:
        with pytest.raises(ValueError, match=f"worker {wid}, saved in this config dir, is active and heartbeating"):
            _register_or_reuse(second, creds, creds.load(api.url), _registration(40123), provider_token, False)
    finally:
        beating.set()
        beats.join(5)

    assert ok(api.admin.get(f"/v1/workers/{wid}"))["status"] != "deregistered", \
        "the second join deregistered the worker the first join is running"
    with api.db.session() as s:
        assert s.scalars(select(Lease.status).where(Lease.id == lease["id"])).one() == "active"
    first.close()
    second.close()


def test_a_worker_shut_out_forgets_only_its_own_saved_credentials(api, tmp_path, monkeypatch):
    """When a running worker's token is refused (it was deregistered elsewhere) the loop calls `join`'s
    `on_deregistered`, which erased whatever worker was saved for the server: by then, that of a second join on
    the machine (one the provider started after deregistering the first). That process ran on, but its next
    restart found no credentials and registered yet another worker (in probation), leaving its registration
    behind. Only the worker this process ran is forgotten now."""
    from echo2_worker import cli
    from echo2_worker.config import CredentialStore, SavedWorker

    provider_token = ok(api.admin.post("/v1/providers", json={"name": "gpu-co"}), 201)["token"]
    config = tmp_path / "config"
    creds = CredentialStore(config)
    ran: list[str] = []

    def run(worker) -> int:  # type: ignore[no-untyped-def]
        ran.append(worker.opt.worker_id)
        # Meanwhile a second join on this machine registered (or reused) another worker and saved it ...
        creds.save(SavedWorker(server=api.url, provider_token=provider_token, worker_id="wrk_second",
                               worker_token="e2w_second", registered_at="2026-01-01T00:00:00+00:00"))
        # ... and this worker's token was refused: Worker.run calls on_deregistered and returns 3.
        worker._on_deregistered()
        return 3

    monkeypatch.setattr(cli, "_run_in_thread", run)
    monkeypatch.setattr(cli, "_install_signals", lambda signal, worker: None)
    monkeypatch.setattr(cli, "check_version", lambda *a: None)
    code = cli.main(["--config-dir", str(config), "join", "--server", api.url, "--token", provider_token,
                     "--no-bench", "--no-relay", "--backend", "transformers", "--gpus", "none", "--json"])
    assert code == 3 and ran and ran[0] != "wrk_second"
    assert CredentialStore(config).load(api.url).worker_id == "wrk_second", \
        "the first worker, shut out, erased the credentials the second join saved"


def _join(control, creds, server: str, token: str, port: int, new: bool):  # type: ignore[no-untyped-def]
    """What cli._join does with the credentials: load the server's entry, register or reuse, save."""
    from echo2_worker.cli import _register_or_reuse
    from echo2_worker.config import SavedWorker, now_iso

    saved = creds.load(server) or SavedWorker(server=server)
    saved.provider_token = token
    body = _registration(port)
    wid, wtoken, _ = _register_or_reuse(control, creds, saved, body, token, new)
    saved.worker_id, saved.worker_token, saved.name = wid, wtoken, body.name
    saved.registered_at = saved.registered_at or now_iso()
    saved.registration = body.model_dump(mode="json")
    creds.save(saved)
    return wid, wtoken


def test_the_first_worker_restarts_as_itself_after_a_second_joined_beside_it_with_new(api, tmp_path) -> None:
    """A second `join` on a config dir whose worker another process runs refuses, and said: "... or pass --new to
    register a second worker beside it" (cli._alive). With --new, the second join saved its worker in the one entry
    credentials.json kept per server, overwriting the first's worker id and token: restarted after a crash, the
    first process no longer found its registration, was refused ("worker <the second's> ... is heartbeating"), and
    the only way on was --new again, a third registration, in probation from scratch. Each worker saved for the
    server is kept now, and a join registered as one of them (its relay port) is that worker."""
    from echo2_worker.config import CredentialStore
    from echo2_worker.control import ControlPlane

    provider_token = ok(api.admin.post("/v1/providers", json={"name": "gpu-co"}), 201)["token"]
    creds = CredentialStore(tmp_path / "config")  # the default config dir, shared by both processes
    control = ControlPlane(api.url)
    first_id, _ = _join(control, creds, api.url, provider_token, 7460, new=False)  # relay on the default port
    control.token = None
    # The second process: its relay falls back to a free port, the join is refused, the provider adds --new.
    second_id, second_token = _join(control, creds, api.url, provider_token, 40123, new=True)
    assert second_id != first_id

    stop = threading.Event()
    second = api.client(second_token)

    def second_process_beats() -> None:
        while not stop.wait(0.5):
            second.post(f"/v1/workers/{second_id}/heartbeat", json={"status": "idle"})

    beats = threading.Thread(target=second_process_beats, daemon=True)
    beats.start()
    try:
        # The first process is killed and started again with the same command (port 7460 is free again).
        control.token = None
        try:
            restarted, _ = _join(control, creds, api.url, provider_token, 7460, new=False)
        except ValueError as exc:
            raise AssertionError(f"the first worker {first_id} cannot restart as itself: {exc}") from None
        assert restarted == first_id, f"the first process came back as {restarted}, not as its worker {first_id}"
    finally:
        stop.set()
        beats.join(5)
        control.close()


# -- a worker on probation restarted after a crash --------------------------------------------------------


def test_a_restarted_worker_on_probation_is_told_the_true_reason_it_gets_no_lease(api, tmp_path):
    """A worker on probation crashes (SIGKILL) holding a lease of 8 prompts and `join` restarts it with the saved
    credentials: same worker, and the new process knows nothing of the old lease, which holds its prompts until
    it expires (lease_ttl_s, 60 s by default). Every lease meanwhile is refused with "on probation: 0 of this
    worker's groups wait for the learner's audit ... retry once they are judged": nothing waits for an audit,
    the prompts held by its own dead lease are what count, and the provider is sent looking for audits that do
    not exist. The refusal should name what it counts (the prompts held in the worker's active leases)."""
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), grpo={"group_size": 2, "prompts_per_step": 16})
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    assert ok(api.admin.get(f"/v1/workers/{wid}"))["trust"] == "probation"
    activate(api, wid, job["id"])
    before_crash = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 8, "version": 0}), 201)
    # SIGKILL; `echo2-worker join` again reuses the saved registration and asks for a lease at once
    again = worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 8, "version": 0})
    assert again.status_code == 409
    detail = again.json()["detail"]
    assert "0 of this worker's groups wait" not in detail and before_crash["id"] in detail, detail


def test_a_worker_whose_own_leases_fill_the_room_still_fails_its_trial(api, tmp_path):
    """The exemption above is for room others took: a worker that leases all the room and never submits would
    otherwise never fail its trial, its own leases being what leaves no room."""
    from scheduler.reconcile import _worker_profile

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=1,
                         grpo={"group_size": 2, "prompts_per_step": 4})
    _, provider = new_provider(api)
    wid, hoarder = new_worker(api, provider, "hoarder")
    activate(api, wid, job["id"])
    lease = ok(hoarder.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 8, "version": 0}), 201)  # all
    assert hoarder.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}).status_code == 409
    with api.db.session() as s:  # activated 200 s ago, leased at once: 8 prompts at its claimed 1 group/s
        row = s.get_one(Worker, wid)
        row.active_since = utcnow() - timedelta(seconds=200)
        s.get_one(Lease, lease["id"]).created_at = utcnow() - timedelta(seconds=199)
        s.commit()
        _worker_profile(s, row, utcnow(), [], api.server.settings)
        assert row.trial_failed_at is not None


def test_an_honest_worker_generating_its_first_lease_longer_than_the_grace_does_not_fail_its_trial(api, tmp_path):
    """A CPU worker claiming 0.02 groups/s (400 s for a lease of 8 prompts) is activated, leases 8 prompts and
    generates them, renewing its lease as the shipped worker does. 200 s in, the trial rule (`delivery_grace_s`,
    120 s from the activation) found nothing delivered and failed it: measured at zero, deactivated (its lease and
    200 s of generation released), not activated again for ten grace periods, and the same at every activation: it
    could never deliver a first group (review finding). A trial holding prompts is spared for IDLE_PATIENCE times
    what they take at its claimed rate (pool.generating); one claiming 1,000 groups/s is not."""
    from scheduler.reconcile import _worker_profile

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), grpo={"group_size": 2, "prompts_per_step": 8})
    _, provider = new_provider(api)
    verdicts = {}
    for name, rate in (("cpu-box", 0.02), ("fast-claim", 1000.0)):
        wid, worker = new_worker(api, provider, name, rollouts_per_s=rate)
        activate(api, wid, job["id"])
        lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 4, "version": 0}), 201)
        with api.db.session() as s:  # activated 205 s ago, its lease granted 200 s ago and renewed since
            s.get_one(Worker, wid).active_since = utcnow() - timedelta(seconds=205)
            s.get_one(Lease, lease["id"]).created_at = utcnow() - timedelta(seconds=200)
            s.commit()
        ok(worker.post(f"/v1/leases/{lease['id']}/renew"))  # within the lease idle rule
        with api.db.session() as s:
            row = s.get_one(Worker, wid)
            profile = _worker_profile(s, row, utcnow(), [], api.server.settings)
            verdicts[name] = (row.trial_failed_at is None, profile.mu > 0)
    assert verdicts == {"cpu-box": (True, True), "fast-claim": (False, False)}, verdicts


def test_a_trial_that_only_sends_late_junk_still_fails_at_the_delivery_grace(api, tmp_path):
    """A trial kept itself alive without delivering: it sent a junk group every few seconds on a lease it had
    released (refused as late: no strike, no audit, no model run), and the idle time pool.generating read stopped at
    any group (review finding). Only groups worth something to their job count as work now."""
    from scheduler.reconcile import _worker_profile

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), grpo={"group_size": 2, "prompts_per_step": 8})
    _, provider = new_provider(api)
    wid, mallory = new_worker(api, provider, "never-delivers", rollouts_per_s=1.0)
    activate(api, wid, job["id"])
    decoy = ok(mallory.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}), 201)
    ok(mallory.post(f"/v1/leases/{decoy['id']}/release"))
    hoard = ok(mallory.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 4, "version": 0}), 201)
    late = ok(mallory.post(f"/v1/leases/{decoy['id']}/rollouts",
                           json={"groups": [group_body(p, 0) for p in decoy["prompts"]]}))["results"]
    assert all(r["status"] == "rejected" for r in late), late
    now = utcnow()
    with api.db.session() as s:  # activated 10 minutes ago; its latest junk group came 3 s ago (it sends one every 5 s)
        row = s.get_one(Worker, wid)
        assert row.strikes == 0  # blameless
        row.active_since = now - timedelta(seconds=600)
        s.get_one(Lease, decoy["id"]).created_at = now - timedelta(seconds=600)
        s.get_one(Lease, decoy["id"]).finished_at = now - timedelta(seconds=599)
        s.get_one(Lease, hoard["id"]).created_at = now - timedelta(seconds=598)
        for r in s.scalars(select(Rollout).where(Rollout.lease_id == decoy["id"])):
            r.created_at = now - timedelta(seconds=3)
        s.commit()
        _worker_profile(s, row, now, [], api.server.settings)
        assert row.trial_failed_at is not None, (
            "a trial 600 s in (delivery_grace_s 120 s) that has delivered no group, holding 4 prompts (12 s of work "
            "at its claimed 1 group/s), was not failed: pool.generating counts its late junk group (refused, no "
            "strike) as work, so idle_seconds is 3 s")
