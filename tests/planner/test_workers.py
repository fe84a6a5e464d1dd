"""WorkerTable: a fleet kept across reconcile steps decides exactly as a fresh list of the same profiles."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.capacity import JobProfile, WorkerProfile
from planner.solver import decide
from planner.workers import WorkerTable

JOB = JobProfile(job_id="j1", rollouts_per_step=100, t_train_s=10.0, staleness=3, headroom=0.0)


def fleet() -> list[WorkerProfile]:
    return [WorkerProfile(f"w{i}", 1.0 + i / 10, vram_gb=24, backends=frozenset({"vllm"}), mu=3.0, t_gen_s=5.0,
                          t_bcast_s=10.0) for i in range(8)]  # fmt: skip


def test_a_kept_table_triggers_as_a_fresh_list_does():
    profiles = fleet()
    table = WorkerTable(profiles)
    first = decide([JOB], table, 0.0)
    assert first.assignment == decide([JOB], profiles, 0.0).assignment
    quiet = decide([JOB], table, 10.0, first.state)
    assert not quiet.resolved
    idle = profiles.index(next(w for w in profiles if w.worker_id not in first.assignment))
    for i, change, trigger in [(idle, {"price_per_h": 0.5}, "price change: "), (0, {"alive": False}, "churn: w0 lost")]:
        profiles[i] = replace(profiles[i], **change)
        table.replace(i, profiles[i])
        assert decide([JOB], table, 20.0, first.state).trigger.startswith(trigger)
        assert decide([JOB], profiles, 20.0, first.state).trigger.startswith(trigger)


def test_a_state_that_went_through_json_is_compared_worker_by_worker():
    table = WorkerTable(fleet())
    first = decide([JOB], table, 0.0)
    thawed = type(first.state).from_dict(first.to_dict()["state"])
    assert not decide([JOB], table, 10.0, thawed).resolved


def test_a_row_holds_one_worker():
    table = WorkerTable(fleet())
    with pytest.raises(ValueError, match="row 0 is worker w0, not w1"):
        table.replace(0, fleet()[1])


def test_a_row_replaced_later_is_rebuilt_when_read_and_keeps_its_mark():
    profiles = fleet()
    table = WorkerTable(profiles)
    first = decide([JOB], table, 0.0)
    built = []
    slower = replace(profiles[5], t_bcast_s=50.0)
    table.replace_later([5], lambda i: built.append(i) or slower)
    assert not decide([JOB], table, 10.0, first.state).resolved and built == []  # a quiet step reads no idle row
    assert table.get("w5") is slower and built == [5]
    table.replace_later([6], lambda i: replace(profiles[i], price_per_h=9.0))
    with pytest.raises(ValueError, match="w6: a new price or liveness takes replace"):
        list(table)
