"""The publisher against a live control plane: versions submitted faster than they publish coalesce
(at most one waits; a newer one replaces it), the newest weights are what is published last, and a
replaced snapshot is freed at once."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from echo2.protocol import WeightsConfig
from safetensors.torch import load_file

from learner.parallel import Solo
from learner.publisher import Publisher
from learner.remote import ControlPlane
from learner.weights import Role, Weights, cast
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
    publisher = Publisher(plane, Weights(model, tok, torch.float32), tmp_path / "publish", chunk_size=64 * 1024)
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

    versions = [r["version"] for r in ok(alice.get(f"/v1/jobs/{jid}/versions"))]
    assert versions == sorted(set(versions)) and versions[-1] == 6 == publisher.published, versions
    assert publisher.skipped and set(publisher.skipped).isdisjoint(versions), (publisher.skipped, versions)
    assert sorted(publisher.skipped + versions) == list(range(7))
    gc.collect()
    assert all(alive[v]() is None for v in publisher.skipped), "a replaced snapshot is still held"
    folder = plane.fetch_version(6, tmp_path / "v6")  # a delta: rebuilt from the keyframe and the deltas
    marker = load_file(folder / "model.safetensors")[MARKER]
    assert torch.equal(marker, torch.full_like(marker, 6.0)), "the last published weights are not the last submitted"
    plane.close()


def test_bf16_versions_travel_as_small_deltas_and_rebuild_bit_for_bit(api, tmp_path, tiny):
    model, tok = tiny
    _, alice = new_user(api)
    jid = ok(alice.post("/v1/jobs", json=job_spec()), 201)["id"]
    plane = ControlPlane(api.url, learner_for(api, jid).headers["Authorization"].split()[1], jid)
    plane.start()
    weights = Weights(model, tok, torch.bfloat16)
    publisher = Publisher(plane, weights, tmp_path / "publish", chunk_size=64 * 1024,
                          config=WeightsConfig(keyframe_every=3))
    master = {k: v.float().clone() for k, v in Solo().model_state(model).items()}
    gen = torch.Generator().manual_seed(0)
    published = {}
    for v in range(7):  # fp32 master weights take Adam-sized steps; versions are published in bf16
        for t in master.values():
            t -= 2e-6 * torch.sign(torch.randn(t.shape, generator=gen))
        published[v] = cast(master, torch.bfloat16)
        publisher.submit(v, v, published[v], final=v == 6)
        publisher.wait()
    reads = {r["version"]: r for r in ok(alice.get(f"/v1/jobs/{jid}/versions"))}
    assert [v for v, r in reads.items() if r["total_size"] is not None] == [0, 3, 6]  # the first, every 3rd, final
    assert all(reads[v]["delta_base"] == v - 1 for v in range(1, 7))
    full = reads[0]["total_size"]
    assert max(reads[v]["delta_size"] for v in range(1, 7)) < 0.1 * full
    for v in range(7):
        expected = tmp_path / f"expected-{v}"
        weights.write(published[v], expected, Role.next)
        got = plane.fetch_version(v, tmp_path / f"got-{v}")
        assert (got / "model.safetensors").read_bytes() == (expected / "model.safetensors").read_bytes(), v
    publisher.close()
    plane.close()
