"""The worker loop against a real control plane (SQLite and PostgreSQL): accepted rollouts, drain,
weight swaps, staleness, relay peers (honest and lying), a load that fails."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import uvicorn
from echo2.prompting import encode_prompt
from echo2.protocol import Manifest
from echo2.transport import RetryPolicy
from echo2_worker import versions
from echo2_worker.backends.base import BackendError
from echo2_worker.backends.transformers_backend import TransformersBackend
from sqlalchemy import select
from transformers import AutoTokenizer

from api.app import create_app
from api.models import Job, Lease, Rollout, Worker
from api.services.fleet import unassign
from api.settings import Settings
from server.local import free_port
from tests.conftest import Api
from tests.factories import activate, new_provider, new_worker, ok, publish

from .conftest import LyingRelay, rollouts, start_job, start_worker, wait_for, worker_row


def active_leases(api: Api, worker_id: str) -> list[Lease]:
    with api.db.session() as s:
        return list(s.scalars(select(Lease).where(Lease.worker_id == worker_id, Lease.status == "active")))


def since_first_of(version: int, newest_first: list[dict]) -> list[dict]:
    """The rollouts from the first one of `version` on. Submissions leave one network thread in
    order, so a group generated before a swap never lands after one generated after it."""
    oldest = max(i for i, r in enumerate(newest_first) if r["version"] == version)
    return newest_first[: oldest + 1]


def wait_for_version(api: Api, job_id: str, version: int, count: int = 3) -> list[dict]:
    """All rollouts, newest first, once `count` of them are of `version`."""
    def enough() -> list[dict] | None:
        rows = rollouts(api, job_id)
        return rows if sum(r["version"] == version for r in rows) >= count else None

    return wait_for(enough, 60, f"{count} rollouts at version {version}")


def test_leaf_worker_produces_accepted_rollouts_then_drains(api: Api, tiny_model_dir: Path, worker_factory) -> None:
    setup = start_job(api, tiny_model_dir)
    w = worker_factory(setup, relay=False)  # --no-relay: a leaf fetches from the origin only
    accepted = wait_for(lambda: rollouts(api, setup.id, "accepted"), 120, "accepted rollouts")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    r = accepted[0]
    assert r["worker_id"] == w.worker_id and r["version"] == 0 and len(r["completions"]) == 2
    with api.db.session() as s:  # the prompt ids follow the shared rule the learner checks
        row = s.get(Rollout, r["id"])
        assert row.prompt_token_ids == encode_prompt(tok, r["prompt_text"])
        assert all(len(x["token_ids"]) == len(x["logprobs"]) >= 1 for x in row.samples)
    row = wait_for(lambda: (x := worker_row(api, w.worker_id))["version_held"] == 0 and x, 30, "version_held")
    assert row["status"] == "active" and row["relay_url"] is None
    assert w.drain() == 0
    assert active_leases(api, w.worker_id) == []
    assert worker_row(api, w.worker_id)["status"] == "deregistered"


def test_newer_version_is_swapped_in_and_tags_later_rollouts(api: Api, tiny_model_dir: Path, next_model_dir: Path,
                                                             worker_factory) -> None:
    setup = start_job(api, tiny_model_dir)
    w = worker_factory(setup)
    wait_for(lambda: rollouts(api, setup.id, "accepted"), 120, "rollouts at version 0")
    publish(setup.learner, setup.id, next_model_dir, version=1, step=0)
    wait_for(lambda: w.worker.versions.loaded == (setup.id, 1), 60, "the swap to version 1")
    later = since_first_of(1, wait_for_version(api, setup.id, 1))
    assert {r["version"] for r in later} == {1} and {r["status"] for r in later} == {"accepted"}
    v0 = w.store.root / setup.id / "v0"
    wait_for(lambda: not v0.exists(), 10, "version 0 to be deleted from disk")  # only versions still needed stay
    held = w.store.get(setup.id, 1)
    manifest = Manifest.model_validate_json((held.model_dir / "manifest.json").read_bytes())
    assert manifest.version == 1
    assert w.drain() == 0


def test_a_too_stale_lease_is_released_not_generated(api: Api, tiny_model_dir: Path, next_model_dir: Path,
                                                     worker_factory) -> None:
    setup = start_job(api, tiny_model_dir, staleness=0, publish_period=1)
    w = worker_factory(setup)
    wait_for(lambda: rollouts(api, setup.id, "accepted"), 120, "rollouts at version 0")
    # The learner trains a step and publishes version 1: version 0 is no longer admissible (S = 0).
    publish(setup.learner, setup.id, next_model_dir, version=1, step=1)
    with api.db.session() as s:
        s.get(Job, setup.id).step = 1
        s.commit()
    wait_for(lambda: w.worker.versions.loaded == (setup.id, 1), 60, "the swap to version 1")
    rows = wait_for_version(api, setup.id, 1)
    stale = [r for r in rows if r["version"] == 0 and r["status"] == "rejected"]
    # Only the leases in flight when the step landed (the current one and the prefetched next one, 4
    # prompts each) can arrive late; nothing is leased with version 0 after the worker hears of it.
    assert len(stale) <= 8
    assert {r["version"] for r in since_first_of(1, rows)} == {1}
    assert w.drain() == 0


class SlowBackend(TransformersBackend):
    """The real transformers backend on a slow machine: each generate call takes at least `delay_s`."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(device="cpu")
        self.delay_s = delay_s

    def generate(self, requests):  # type: ignore[no-untyped-def]
        time.sleep(self.delay_s)
        return super().generate(requests)


def test_a_lease_going_stale_mid_way_is_released(api: Api, tiny_model_dir: Path, next_model_dir: Path,
                                                 worker_factory) -> None:
    setup = start_job(api, tiny_model_dir, staleness=0, publish_period=1)
    # 3 s a group: the lease (4 groups) cannot finish while version 1 is published and announced.
    w = worker_factory(setup, backend_factory=lambda: SlowBackend(3.0), gen_batch_prompts=1)
    wait_for(lambda: w.worker.leases.active() and rollouts(api, setup.id), 120, "a lease half done")
    lease_id = w.worker.leases.active()[0].id
    publish(setup.learner, setup.id, next_model_dir, version=1, step=1)
    with api.db.session() as s:
        s.get(Job, setup.id).step = 1
        s.commit()
    wait_for(lambda: w.worker.versions.loaded == (setup.id, 1), 60, "the swap to version 1")
    with api.db.session() as s:
        lease = s.get(Lease, lease_id)
        assert lease.status == "released"
        mine = s.scalars(select(Rollout).where(Rollout.lease_id == lease_id)).all()
    assert len(mine) < 4  # the rest of the lease was given back, not generated
    late = [r for r in mine if r.status == "rejected"]
    assert len(late) <= 2  # at most what was generated before the next heartbeat told the worker
    assert w.drain() == 0


def test_peers_relay_chunks_and_a_lying_peer_is_rejected_and_reported(api: Api, tiny_model_dir: Path,
                                                                       worker_factory) -> None:
    setup = start_job(api, tiny_model_dir)
    manifest = Manifest.model_validate(api.admin.get(f"/v1/jobs/{setup.id}/versions/0/manifest").json())
    liar = LyingRelay(lambda job, v, i: manifest.chunks[i].size if i < len(manifest.chunks) else None)
    try:
        # The liar, another provider's, has been measured fast by a third provider's download, so the
        # control plane puts it at the root of the relay tree.
        _, other = new_provider(api, "liar-co")
        liar_id, _ = new_worker(api, other, "liar", relay_url=liar.url)
        activate(api, liar_id, setup.id)
        _, third = new_provider(api, "measurer-co")
        measurer_id, measurer = new_worker(api, third, "measurer")
        activate(api, measurer_id, setup.id)  # on the job: what it says of the job's relays counts
        size = 8 * 2**20
        ok(measurer.post(f"/v1/workers/{measurer_id}/heartbeat",
                         json={"fetched_from": [{"url": liar.url, "bytes": size, "seconds": 0.1}]}))
        honest = worker_factory(setup, "honest", relay=True, upload_mbps=100)
        wait_for(lambda: rollouts(api, setup.id, "accepted"), 120, "accepted rollouts despite the liar")
        assert liar.requests >= 1
        held = honest.store.get(setup.id, 0)
        assert held is not None and held.complete
        wait_for(lambda: worker_row(api, liar_id)["bad_chunks"] >= 1, 15, "the liar to be flagged")
        # The scheduler would now drop the flagged liar; a third worker then hangs under the honest relay.
        with api.db.session() as s:
            unassign(s, s.get(Worker, liar_id))
            s.commit()
        leaf = worker_factory(setup, "leaf", relay=False, upload_mbps=1)
        wait_for(lambda: leaf.worker.versions.loaded == (setup.id, 0), 60, "the leaf to load version 0")
        served = honest.relay.served_chunks
        assert served >= 1, "the leaf should have fetched from its peer, not only from the origin"
        assert worker_row(api, honest.worker_id)["bad_chunks"] == 0
        assert leaf.drain() == 0 and honest.drain() == 0
    finally:
        liar.close()


def serve(api: Api, port: int, lease_ttl_s: float = 30,
          heartbeat_interval_s: float = 1) -> tuple[uvicorn.Server, threading.Thread]:
    """A second control-plane process-alike on the same database and blob store, on a fixed port."""
    base = api.server.settings
    settings = Settings(data_dir=base.data_dir, database_url=base.database_url, port=port, lease_ttl_s=lease_ttl_s,
                        heartbeat_interval_s=heartbeat_interval_s)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "uvicorn to start", every=0.05)
    return server, thread


@pytest.mark.postgres_only
def test_a_new_version_is_heard_of_long_before_the_next_heartbeat(api: Api, tiny_model_dir: Path,
                                                                  next_model_dir: Path, worker_factory) -> None:
    port = free_port()
    server, thread = serve(api, port, heartbeat_interval_s=60)  # heartbeats alone would bring it in a minute
    try:
        setup = start_job(api, tiny_model_dir)
        w = worker_factory(setup, server_url=f"http://127.0.0.1:{port}")
        wait_for(lambda: w.worker.versions.loaded == (setup.id, 0), 120, "version 0 loaded")
        time.sleep(2)  # the worker's notice poll is waiting now
        publish(setup.learner, setup.id, next_model_dir, version=1, step=1)  # through the other API process
        published = time.monotonic()
        wait_for(lambda: w.worker.versions.loaded == (setup.id, 1), 30, "the swap to version 1", every=0.05)
        # the other process's waiters recheck the database every 2 s (notices.RECHECK_S)
        assert time.monotonic() - published < 10
        assert w.drain() == 0
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.mark.postgres_only
def test_control_plane_restart_is_survived(api: Api, tiny_model_dir: Path, worker_factory) -> None:
    setup = start_job(api, tiny_model_dir)
    port = free_port()
    server, thread = serve(api, port)
    w = worker_factory(setup, server_url=f"http://127.0.0.1:{port}")
    wait_for(lambda: rollouts(api, setup.id, "accepted"), 120, "accepted rollouts")
    server.should_exit = True
    thread.join(30)
    time.sleep(4)  # heartbeats, leases and submissions fail meanwhile; the worker backs off
    assert w.thread.is_alive()
    n = len(rollouts(api, setup.id, "accepted"))
    server, thread = serve(api, port)
    try:
        wait_for(lambda: len(rollouts(api, setup.id, "accepted")) > n, 120, "rollouts after the restart")
        assert w.drain() == 0
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.mark.postgres_only
def test_a_lease_longer_than_its_ttl_is_renewed(api: Api, tiny_model_dir: Path, worker_factory) -> None:
    port = free_port()
    # A lease of 4 batches of 2.5 s outlives its TTL; renewal (the first heartbeat after TTL/2) has 2-3 s.
    server, thread = serve(api, port, lease_ttl_s=6)
    try:
        setup = start_job(api, tiny_model_dir)
        w = worker_factory(setup, server_url=f"http://127.0.0.1:{port}", gen_batch_prompts=1,
                           backend_factory=lambda: SlowBackend(2.5))
        wait_for(lambda: w.stats.leases_done >= 1, 120, "a whole lease")
        with api.db.session() as s:
            first = s.scalars(select(Lease).where(Lease.worker_id == w.worker_id).order_by(Lease.created_at)).first()
            assert first.status == "completed"
            last = max(r.created_at for r in s.scalars(select(Rollout).where(Rollout.lease_id == first.id)))
            assert (last - first.created_at).total_seconds() > 6  # its last group came after one TTL
        assert w.stats.rollouts_rejected == 0
        assert w.drain() == 0
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_worker_whose_disk_is_full_says_where_and_how_much_it_needs(api: Api, tiny_model_dir: Path, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """It logged "[Errno 28] No space left on device" every few seconds, naming neither the folder nor the size."""
    import subprocess

    disk = tmp_path / "small-disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a 256 KiB tmpfs needs root")
    try:
        setup = start_job(api, tiny_model_dir)
        worker = start_worker(api, setup, disk, name="full")

        def said() -> list[str]:
            return [r.getMessage() for r in caplog.records if "no space left on the disk of" in r.getMessage()]

        wait_for(said, 60, "the worker to say its disk is full")
        assert f"no space left on the disk of {disk / 'versions'}: this version needs " in said()[0]
        assert "GB are free; free some, or give --data-dir on a larger disk" in said()[0]
        worker.drain()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_worker_told_an_unreachable_address_for_weights_names_the_setting_to_fix(
        api: Api, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A control plane started without ECHO2_PUBLIC_URL tells remote workers to fetch weights from its own
    loopback address: the worker heartbeat fine and logged only "could not reach the Echo2 server", as if the
    server it was talking to were down."""
    setup = start_job(api, tiny_model_dir)
    monkeypatch.setattr(api.server.settings, "public_url", "http://127.0.0.1:9")  # nothing listens there
    worker = start_worker(api, setup, tmp_path / "w", name="far")

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "could not fetch version" in r.getMessage()]

    wait_for(said, 60, "the worker to say why it cannot fetch")
    assert (f"this worker reaches the control plane at {api.url}, which names http://127.0.0.1:9 for its weights "
            "(its ECHO2_PUBLIC_URL)") in said()[0]
    assert "ask its operator to set ECHO2_PUBLIC_URL to an address workers can reach" in said()[0]
    worker.drain()


# -- a load that fails -------------------------------------------------------------------------------------
# Loading a model on a GPU fails transiently in ordinary ways (CUDA out of memory while another process on the card
# frees its memory, a vLLM engine that fails to start once). A failed generation was retried, a failed load
# (`Versions._swap`, from `Worker._hold`) left `Worker.run`, whose `finally` deregistered the worker (its token
# revoked, its credentials forgotten by the CLI): the process exited after one transient error.


class FlakyLoad(TransformersBackend):
    """The real transformers backend, whose first load on this machine fails (as a CUDA OOM would)."""

    failures = 0

    def __init__(self) -> None:
        super().__init__(device="cpu")

    def load(self, model_dir, adapter_dir=None, *, lora_rank=None):  # type: ignore[no-untyped-def]
        if FlakyLoad.failures == 0:
            FlakyLoad.failures += 1
            raise BackendError("CUDA out of memory. Tried to allocate 20.00 MiB (transient)")
        return super().load(model_dir, adapter_dir, lora_rank=lora_rank)


def test_a_load_that_fails_once_does_not_end_the_worker(api: Api, tiny_model_dir: Path, worker_factory) -> None:
    FlakyLoad.failures = 0
    setup = start_job(api, tiny_model_dir)
    w = worker_factory(setup, backend_factory=FlakyLoad)
    wait_for(lambda: FlakyLoad.failures == 1, 120, "the first load to fail")
    w.thread.join(10)
    assert w.thread.is_alive(), (
        f"one failed load ended the worker: it is {worker_row(api, w.worker_id)['status']} on the control plane "
        "(a failed generation is retried; a failed load is not)")
    wait_for(lambda: rollouts(api, setup.id, "accepted"), 120, "accepted rollouts after the load is retried")


class NeverLoads(TransformersBackend):
    def __init__(self) -> None:
        super().__init__(device="cpu")

    def load(self, model_dir, adapter_dir=None, *, lora_rank=None):  # type: ignore[no-untyped-def]
        raise BackendError("CUDA out of memory. Tried to allocate 20.00 MiB")


def test_a_load_that_keeps_failing_is_said_and_retried_while_the_worker_stays(
        api: Api, tiny_model_dir: Path, worker_factory, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "DOWNLOAD_PAUSES", RetryPolicy(initial_delay=0.1, max_delay=0.2))
    setup = start_job(api, tiny_model_dir)
    w = worker_factory(setup, backend_factory=NeverLoads)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "failed to load" in r.getMessage()]

    wait_for(said, 120, "the worker to say its load keeps failing")
    assert said()[0].startswith(f"version 0 of job {setup.id} failed to load 3 times in a row: this worker generates "
                                "nothing until it loads")
    assert w.thread.is_alive() and worker_row(api, w.worker_id)["status"] != "deregistered"
