"""A Tinker user's two views of what it spent agree. `api/tinker/service.py::record_result` billed every request a host
ran but an audit, so the `drop_checkpoint` the control plane queues when a sampler checkpoint is deleted (or
expires: the platform's own request, run whatever the quota) was a user's ledger entry at the host's price, which
the SDK's billing usage (`/api/v1/billing/usage/events`) left out of its total. The platform's requests are not
billed to users now (`service.PLATFORMS`)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tests.factories import new_user, ok
from tests.tinker.test_async_routes import sampler_of
from tests.tinker.test_routes import claim, key_of, ready_model, report, sdk


def test_billing_usage_events_add_up_to_the_tinker_ledger(api):
    _, alice = new_user(api)
    client = sdk(api, key_of(alice))
    _, model_id = ready_model(api, client)
    sampler_of(api, client, model_id, seq=5)
    ok(client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/sampler-5"))
    work = claim(api, holding=[model_id], price=3600.0)["work"]
    assert work["kind"] == "drop_checkpoint"
    report(api, work, seconds=2.0)  # the host forgets the sampler's weights: 2 s of its time at $3600/h

    usage = ok(alice.get("/v1/tinker/usage"))
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    params = {"starting_on": (hour - timedelta(hours=1)).isoformat(),
              "ending_before": (hour + timedelta(hours=1)).isoformat()}
    events = ok(client.get("/api/v1/billing/usage/events", params=params))["data"]
    billed = sum(e["estimated_cost_usd"] for e in events)
    assert billed == pytest.approx(usage["total_usd"]), (
        f"billing usage events sum to ${billed:.2f}, the Tinker ledger to ${usage['total_usd']:.2f}: "
        f"{[(t['key'], t['amount_usd']) for t in usage['by_kind']]}")
