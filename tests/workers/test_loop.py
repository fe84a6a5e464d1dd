"""The worker loop against a real control plane (SQLite and PostgreSQL): accepted rollouts, drain,
weight swaps, staleness, relay peers (honest and lying)."""

from __future__ import annotations

from pathlib import Path

from echo2.prompting import encode_prompt
from echo2.protocol import Manifest
from sqlalchemy import select
from transformers import AutoTokenizer

from api.models import Job, Lease, Worker
from api.services.fleet import unassign
from tests.conftest import Api
from tests.factories import activate, publish

from .conftest import LyingRelay, rollouts, start_job, wait_for, worker_row


def active_leases(api: Api, worker_id: str) -> list[Lease]:
    with api.db.session() as s:
        return list(s.scalars(select(Lease).where(Lease.worker_id == worker_id, Lease.status == "active")))


def test_leaf_worker_produces_accepted_rollouts_then_drains(api: Api, tiny_model_dir: Path, worker_factory) -> None:
    setup = start_job(api, tiny_model_dir)
    w = worker_factory(setup, relay=False)  # --no-relay: a leaf fetches from the origin only
    accepted = wait_for(lambda: rollouts(api, setup.id, "accepted"), 120, "accepted rollouts")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    r = accepted[0]
    assert r["worker_id"] == w.worker_id and r["version"] == 0 and len(r["completions"]) == 2
    with api.db.session() as s:  # the prompt ids follow the shared rule the learner checks
        from api.models import Rollout

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
    wait_for(lambda: w.worker._loaded == (setup.id, 1), 60, "the swap to version 1")
    seen = len(rollouts(api, setup.id))

    def later() -> list[dict]:
        newest_first = rollouts(api, setup.id)
        return newest_first[: len(newest_first) - seen]

    later = wait_for(later, 60, "rollouts after the swap")
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
    wait_for(lambda: w.worker._loaded == (setup.id, 1), 60, "the swap to version 1")
    n = len(rollouts(api, setup.id))
    wait_for(lambda: len(rollouts(api, setup.id)) > n + 2, 60, "rollouts at version 1")
    stale = [r for r in rollouts(api, setup.id) if r["version"] == 0 and r["status"] == "rejected"]
    # At most the one lease in flight when the step landed can be late; nothing is leased with v0 after.
    assert len(stale) <= 4
    assert {r["version"] for r in rollouts(api, setup.id)[:2]} == {1}
    assert w.drain() == 0


def test_peers_relay_chunks_and_a_lying_peer_is_rejected_and_reported(api: Api, tiny_model_dir: Path,
                                                                       worker_factory) -> None:
    setup = start_job(api, tiny_model_dir)
    manifest = Manifest.model_validate(api.admin.get(f"/v1/jobs/{setup.id}/versions/0/manifest").json())
    liar = LyingRelay(lambda job, v, i: manifest.chunks[i].size if i < len(manifest.chunks) else None)
    try:
        # The liar claims the best uplink, so the control plane puts it at the root of the relay tree.
        liar_id = setup.provider.post("/v1/workers", json={"name": "liar", "relay_url": liar.url,
                                                            "upload_mbps": 10_000}).json()["worker"]["id"]
        activate(api, liar_id, setup.id)
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
        wait_for(lambda: leaf.worker._loaded == (setup.id, 0), 60, "the leaf to load version 0")
        served = honest.relay.served_chunks
        assert served >= 1, "the leaf should have fetched from its peer, not only from the origin"
        assert worker_row(api, honest.worker_id)["bad_chunks"] == 0
        assert leaf.drain() == 0 and honest.drain() == 0
    finally:
        liar.close()
