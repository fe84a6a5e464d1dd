"""The publisher against a live control plane: versions submitted faster than they publish coalesce
(at most one waits; a newer one replaces it), the newest weights are what is published last, and a
replaced snapshot is freed at once."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from echo2.protocol import Manifest
from echo2.snapshots import assemble
from safetensors.torch import load_file

from learner.parallel import Solo
from learner.publisher import Publisher
from learner.remote import ControlPlane
from tests.factories import job_spec, learner_for, new_user, ok

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
MARKER = "model.norm.weight"


def snapshot(model, version: int) -> dict[str, torch.Tensor]:
    state = Solo().model_state(model)
    state[MARKER].fill_(float(version))  # tells the versions' weights apart
    return state


def test_rapid_submits_coalesce(api, tmp_path, tiny):
    model, tok = tiny
    _, alice = new_user(api)
    jid = ok(alice.post("/v1/jobs", json=job_spec()), 201)["id"]
    plane = ControlPlane(api.url, learner_for(api, jid).headers["Authorization"].split()[1], jid)
    plane.start()
    publisher = Publisher(plane, model, tok, tmp_path / "publish", chunk_size=64 * 1024)
    publisher.submit(0, 0, snapshot(model, 0))
    publisher.wait()
    alive = {}
    for v in range(1, 7):  # each publication takes far longer than a snapshot: most get replaced
        state = snapshot(model, v)
        alive[v] = weakref.ref(state[MARKER])
        publisher.submit(v, v, state)
        del state
    publisher.wait()
    publisher.close()
    plane.close()

    versions = [r["version"] for r in ok(alice.get(f"/v1/jobs/{jid}/versions"))]
    assert versions == sorted(set(versions)) and versions[-1] == 6 == publisher.published, versions
    assert publisher.skipped and set(publisher.skipped).isdisjoint(versions), (publisher.skipped, versions)
    assert sorted(publisher.skipped + versions) == list(range(7))
    gc.collect()
    assert all(alive[v]() is None for v in publisher.skipped), "a replaced snapshot is still held"
    manifest = Manifest.model_validate(ok(alice.get(f"/v1/jobs/{jid}/versions/6/manifest")))
    folder = assemble(manifest, lambda i: alice.get(f"/v1/jobs/{jid}/versions/6/chunks/{i}").content, tmp_path / "v6")
    marker = load_file(folder / "model.safetensors")[MARKER]
    assert torch.equal(marker, torch.full_like(marker, 6.0)), "the last published weights are not the last submitted"
