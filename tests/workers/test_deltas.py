"""Workers fetch versions as deltas through the real control plane: rebuilt bit for bit before they are
loaded, refused when they do not fit the held base (the worker falls back to the keyframe), and taken
from the origin when a relay peer serves bad delta chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
from echo2.deltas import Folder, build_delta, file_refs
from echo2.protocol import Form, Manifest

from api.models import Worker
from api.services.fleet import unassign
from tests.conftest import Api
from tests.factories import activate, new_provider, new_worker, ok, publish_forms

from .conftest import JobSetup, LyingRelay, rollouts, start_job, wait_for, worker_row

# What is tested here is the worker's; the control plane's side of deltas runs on both databases in
# tests/api/test_delta_versions.py.
pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def publish_delta(setup: JobSetup, base: Path, target: Path, version: int, base_version: int, out: Path) -> Manifest:
    manifest = build_delta(Folder(base_version, base, file_refs(base)), Folder(version, target, file_refs(target)),
                           out, version, chunk_size=64 * 1024)
    assert manifest is not None
    publish_forms(setup.learner, setup.id, [(out, manifest)])
    return manifest


def rebuilt_bit_for_bit(store, job_id: str, version: int, expected: Path) -> bool:  # type: ignore[no-untyped-def]
    folder = store.loadable(job_id, version)
    return folder is not None and all((folder.path / ref.path).read_bytes() == (expected / ref.path).read_bytes()
                                      for ref in file_refs(expected))


def test_a_delta_is_fetched_rebuilt_bit_for_bit_and_swapped_in(api: Api, tiny_model_dir: Path, next_model_dir: Path,
                                                              worker_factory, tmp_path: Path) -> None:
    setup = start_job(api, tiny_model_dir)
    w = worker_factory(setup)
    wait_for(lambda: rollouts(api, setup.id, "accepted"), 120, "rollouts at version 0")
    publish_delta(setup, tiny_model_dir, next_model_dir, 1, 0, tmp_path / "d1")
    wait_for(lambda: w.worker.versions.loaded == (setup.id, 1), 60, "the swap to version 1")
    assert rebuilt_bit_for_bit(w.store, setup.id, 1, next_model_dir)
    assert w.store.get(setup.id, 1, Form.delta) is not None and w.store.get(setup.id, 1, Form.full) is None
    wait_for(lambda: [r for r in rollouts(api, setup.id) if r["version"] == 1], 60, "rollouts at version 1")
    assert w.drain() == 0


def test_a_delta_that_does_not_fit_the_held_base_is_refused_and_the_keyframe_fetched(
        api: Api, tiny_model_dir: Path, next_model_dir: Path, worker_factory, tmp_path: Path) -> None:
    setup = start_job(api, tiny_model_dir)
    w = worker_factory(setup)
    wait_for(lambda: w.worker.versions.loaded == (setup.id, 0), 120, "version 0 loaded")
    held = w.store.get(setup.id, 0)
    assert held is not None
    weights = next(held.model_dir.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the held base no longer is what the worker verified (disk corruption, tampering);
    changed = weights.with_name("changed")  # a new file renamed over it: the loaded backend maps the old one
    changed.write_bytes(bytes(data))
    changed.replace(weights)
    publish_delta(setup, tiny_model_dir, next_model_dir, 1, 0, tmp_path / "d1")
    # The rebuilt file fails its sha256: refused before any load, the base dropped, version 0 fetched
    # again whole (the keyframe) and the delta applied to it.
    wait_for(lambda: w.worker.versions.loaded == (setup.id, 1), 90, "the swap to version 1 after the fallback")
    assert rebuilt_bit_for_bit(w.store, setup.id, 1, next_model_dir)
    assert w.drain() == 0


def test_bad_delta_chunks_from_a_relay_peer_are_refused_and_fetched_from_the_origin(
        api: Api, tiny_model_dir: Path, next_model_dir: Path, worker_factory, tmp_path: Path) -> None:
    setup = start_job(api, tiny_model_dir)
    manifest: list[Manifest] = []
    liar = LyingRelay(lambda job, v, i: manifest[0].chunks[i].size if manifest and i < len(manifest[0].chunks)
                      else None)
    try:
        _, other = new_provider(api, "liar-co")
        liar_id, _ = new_worker(api, other, "liar", relay_url=liar.url)
        activate(api, liar_id, setup.id)
        _, third = new_provider(api, "measurer-co")
        measurer_id, measurer = new_worker(api, third, "measurer")  # measured the liar fast: the tree's root
        activate(api, measurer_id, setup.id)
        ok(measurer.post(f"/v1/workers/{measurer_id}/heartbeat",
                         json={"fetched_from": [{"url": liar.url, "bytes": 8 * 2**20, "seconds": 0.1}]}))
        w = worker_factory(setup, "honest", relay=True)
        wait_for(lambda: w.worker.versions.loaded == (setup.id, 0), 120, "version 0 loaded")
        requests_before = liar.requests
        manifest.append(publish_delta(setup, tiny_model_dir, next_model_dir, 1, 0, tmp_path / "d1"))
        wait_for(lambda: w.worker.versions.loaded == (setup.id, 1), 60, "the swap to version 1 despite the liar")
        assert liar.requests > requests_before
        assert rebuilt_bit_for_bit(w.store, setup.id, 1, next_model_dir)
        wait_for(lambda: worker_row(api, liar_id)["bad_chunks"] >= 1, 15, "the liar to be flagged")
        with api.db.session() as s:
            unassign(s, s.get(Worker, liar_id))
            s.commit()
        assert w.drain() == 0
    finally:
        liar.close()
