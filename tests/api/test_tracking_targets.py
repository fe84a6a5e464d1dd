"""A job's experiment tracker runs on the learner host with the host's own credentials and disk: where it may send
or write is checked at submission (api/services/trackers.py)."""

from __future__ import annotations

import pytest

from tests.factories import job_spec, new_user, ok

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def mlflow(uri: str) -> dict:
    return {"kind": "mlflow", "project": "p", "uri": uri}


def wandb(folder: str) -> dict:
    return {"kind": "wandb", "project": "p", "mode": "offline", "dir": folder}


def refused(client, tracking: dict, field: str, says: str) -> None:  # type: ignore[no-untyped-def]
    for route in ("/v1/jobs", "/v1/jobs:estimate"):
        answer = client.post(route, json=job_spec(tracking=tracking))
        assert answer.status_code == 422, (route, tracking, answer.text)
        assert answer.json()["errors"][0]["field"] == field and says in answer.text, answer.text


def test_in_production_a_job_names_only_trackers_the_operator_allows(api, tmp_path):
    """Else a tenant names its own server and the learner host sends it the operator's MLFLOW_TRACKING_TOKEN (or
    WANDB_API_KEY), or names a folder anywhere on the host for it to write in."""
    _, mallory = new_user(api, "mallory")
    settings = api.server.settings
    runs = tmp_path / "runs"
    settings.env, settings.tracking_targets = "production", ["http://mlflow.internal:5000", str(runs)]
    try:
        for tracking in (mlflow("http://127.0.0.1:9/"), mlflow("http://mlflow.internal:5000.evil.com/"),
                         mlflow(f"sqlite:///{tmp_path}/elsewhere.db"), mlflow(f"sqlite:///{runs}/../../x.db")):
            refused(mallory, tracking, "tracking.uri", "ECHO2_TRACKING_TARGETS")
        refused(mallory, wandb(str(tmp_path / "ssh")), "tracking.dir", "not a tracker this platform's learner hosts")
        for tracking in (mlflow("http://mlflow.internal:5000"), mlflow("http://mlflow.internal:5000/team-a"),
                         mlflow(f"sqlite:///{runs}/m.db"), wandb(str(runs / "a")), {"kind": "wandb", "project": "p"}):
            ok(mallory.post("/v1/jobs", json=job_spec(tracking=tracking)), 201)
    finally:
        settings.env, settings.tracking_targets = "dev", []


def test_a_tracker_inside_the_platforms_own_data_or_database_is_refused(api, tmp_path):
    """`echo2-server up` runs the learner host beside the control plane: MLflow pointed at the platform's database
    created its tables there (and stopped on its alembic_version), W&B pointed into the data folder wrote among
    other jobs' files."""
    _, mallory = new_user(api, "mallory")
    settings = api.server.settings
    assert settings.database_url.startswith("sqlite:///")
    refused(mallory, mlflow(settings.database_url), "tracking.uri", "the platform's own database")
    refused(mallory, mlflow(settings.database_url.replace("sqlite://", "sqlite+pysqlite://", 1)), "tracking.uri",
            "the platform's own database")  # MLflow opens a dialect+driver URI as the same store
    refused(mallory, mlflow(f"sqlite+pysqlite:///{settings.data_dir}/x.db"), "tracking.uri", "inside Echo2's own data")
    refused(mallory, mlflow(f"sqlite:///{settings.data_dir}/x.db"), "tracking.uri", "inside Echo2's own data")
    refused(mallory, mlflow(f"file://{settings.data_dir}/mlruns"), "tracking.uri", "inside Echo2's own data")
    refused(mallory, wandb(str(settings.data_dir / "learner")), "tracking.dir", "inside Echo2's own data")
    (tmp_path / "link").symlink_to(settings.data_dir)
    refused(mallory, wandb(str(tmp_path / "link" / "w")), "tracking.dir", "inside Echo2's own data")
    ok(mallory.post("/v1/jobs", json=job_spec(tracking=mlflow(f"sqlite:///{tmp_path}/mine.db"))), 201)
