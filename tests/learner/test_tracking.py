"""A job streams its metrics to an experiment tracker from the learner: the learner process against a live
control plane with real rollouts from the tiny model, once to Weights & Biases in offline mode (its run
directory on disk) and once to MLflow's local file store; each holds the job's training, cost and held-out
curves, step by step."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from server.demo import demo_spec
from tests.factories import activate, new_provider, new_user, new_worker, ok
from tests.learner.live import finish, start_learner
from tests.rollout_driver import RolloutDriver

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
STEPS = 3
BLOCK = 32 * 1024


def train(api, tmp_path: Path, tracking: dict) -> tuple[str, dict]:  # type: ignore[no-untyped-def]
    _, alice = new_user(api)
    spec = demo_spec("tiny", STEPS, staleness=1) | {"tracking": tracking, "eval": {"size": 4, "every": 2}}
    job = ok(alice.post("/v1/jobs", json=spec), 201)
    live = start_learner(api, job["id"], tmp_path / "learner")
    _, provider = new_provider(api)
    wid, client = new_worker(api, provider, "w")
    activate(api, wid, job["id"])
    driver = RolloutDriver(api.url, wid, client.headers["Authorization"].split()[1], tmp_path / "w").start()
    finish(live, [driver], timeout_s=300, poll_s=0.5)
    final = ok(alice.get(f"/v1/jobs/{job['id']}"))
    assert final["status"] == "succeeded", final
    return job["id"], {"metrics": ok(alice.get(f"/v1/jobs/{job['id']}/metrics")),
                       "evals": ok(alice.get(f"/v1/jobs/{job['id']}/evals")), "job": final}


def test_wandb_offline_run_holds_the_jobs_curves(api, tmp_path):
    wandb_dir = tmp_path / "wandb-runs"
    job_id, seen = train(api, tmp_path, {"kind": "wandb", "project": "echo2-tests", "mode": "offline",
                                         "dir": str(wandb_dir)})
    runs = list((wandb_dir / "wandb").glob(f"offline-run-*-{job_id}"))
    assert len(runs) == 1, list(wandb_dir.rglob("*"))[:20]
    from wandb.proto import wandb_internal_pb2

    history: list[dict[str, float]] = []
    for data in wandb_records(next(runs[0].glob("*.wandb")).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): float(item.value_json)
                            for item in record.history.item if item.value_json not in ("", "null")})
    rewards = [h["train/reward_mean"] for h in history if "train/reward_mean" in h]
    assert rewards == pytest.approx([m["reward_mean"] for m in seen["metrics"]])
    assert [h["_step"] for h in history if "train/loss" in h] == [0, 1, 2]
    assert all(h["cost/total_usd"] >= 0 for h in history if "cost/total_usd" in h)
    heldout = [h["heldout/greedy_accuracy"] for h in history if "heldout/greedy_accuracy" in h]
    assert heldout == pytest.approx([e["greedy_accuracy"] for e in seen["evals"]])


def wandb_records(data: bytes) -> list[bytes]:
    """The records of a W&B run file (.wandb): a 7-byte header, then LevelDB-log blocks of 32 KiB whose records
    have a 7-byte header each (crc32, length, type: full, first, middle, last)."""
    assert data[:4] == b":W&B", data[:7]
    out, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            out.append(pending)
    return out


def test_mlflow_file_store_holds_the_jobs_curves(api, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    uri = f"file://{tmp_path / 'mlruns'}"
    job_id, seen = train(api, tmp_path, {"kind": "mlflow", "project": "echo2-tests", "uri": uri})
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("echo2-tests")
    run, = client.search_runs([experiment.experiment_id], filter_string=f"tags.echo2_job = '{job_id}'")
    assert run.info.status == "FINISHED" and run.data.params["max_steps"] == str(STEPS)
    rewards = client.get_metric_history(run.info.run_id, "train/reward_mean")
    assert [m.step for m in rewards] == [m["step"] for m in seen["metrics"]]
    assert [m.value for m in rewards] == pytest.approx([m["reward_mean"] for m in seen["metrics"]])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "cost/total_usd")] == [0, 1, 2]
    heldout = client.get_metric_history(run.info.run_id, "heldout/greedy_accuracy")
    assert [(m.step, m.value) for m in heldout] == [(e["step"], e["greedy_accuracy"]) for e in seen["evals"]]
