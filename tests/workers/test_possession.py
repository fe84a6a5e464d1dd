"""An honest worker proves it holds each version (a keyframe, then a delta-only version it rebuilt) before it
leases at it, at once rather than at its next heartbeat, and is never struck for it."""

from __future__ import annotations

from pathlib import Path

import pytest
from echo2.deltas import Folder, build_delta, file_refs
from echo2.possession import draw_probes
from sqlalchemy import select

from api.models import VersionHold, WeightVersion
from tests.conftest import Api
from tests.factories import publish_forms

from .conftest import rollouts, start_job, wait_for, worker_row

# The control plane's side runs on both databases in tests/api/test_possession.py.
pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
INTERVAL_S = 30.0  # a proof sent at the next heartbeat instead of at once would come this late


def test_an_honest_worker_proves_each_version_before_leasing_it(api: Api, tiny_model_dir: Path, next_model_dir: Path,
                                                               worker_factory, tmp_path: Path) -> None:
    api.server.settings.heartbeat_interval_s = INTERVAL_S
    try:
        setup = start_job(api, tiny_model_dir, probes=True)
        w = worker_factory(setup)
        wait_for(lambda: rollouts(api, setup.id, "accepted"), 120, "rollouts at version 0")
        base = Folder(0, tiny_model_dir, file_refs(tiny_model_dir))
        target = Folder(1, next_model_dir, file_refs(next_model_dir))
        delta = build_delta(base, target, tmp_path / "d1", 1, chunk_size=64 * 1024)
        assert delta is not None
        publish_forms(setup.learner, setup.id, [(tmp_path / "d1", delta)],
                      draw_probes(next_model_dir, target.files, base))  # as the learner draws them
        wait_for(lambda: [r for r in rollouts(api, setup.id, "accepted") if r["version"] == 1], 60,
                 "rollouts at version 1")
    finally:
        api.server.settings.heartbeat_interval_s = 1
    with api.db.session() as s:
        holds = {h.version: h for h in s.scalars(select(VersionHold).where(VersionHold.worker_id == w.worker_id))}
        announced = s.get(WeightVersion, (setup.id, 1)).created_at
    assert holds[0].proven_at is not None and holds[1].proven_at == holds[1].held_at
    assert (holds[1].proven_at - announced).total_seconds() < INTERVAL_S / 2
    row = worker_row(api, w.worker_id)
    assert row["trust"] == "trusted" and row["trust_reason"] is None
    assert w.drain() == 0
