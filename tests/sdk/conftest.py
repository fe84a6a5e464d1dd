"""SDK fixtures: SDK clients against the real control plane (`api`), and a job driven through a step."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from echo2 import Client

from tests.conftest import ADMIN_KEY, Api
from tests.factories import (
    activate,
    fake_model_folder,
    learner_for,
    new_provider,
    new_worker,
    ok,
    publish,
    submit_group,
)

from .stub import Reply, StubServer

# Small enough that a test submits and cancels quickly; the arithmetic task needs no dataset.
SPEC = {"name": "sdk-arith", "base_model": "echo2:tiny", "task": {"name": "arithmetic"},
        "grpo": {"group_size": 2, "prompts_per_step": 4}, "num_prompts": 12, "staleness": 1, "max_steps": 3}


@dataclass
class User:
    id: str
    key: str
    client: Client


@pytest.fixture
def admin(api: Api) -> Iterator[Client]:
    with Client(api.url, ADMIN_KEY) as client:
        yield client


@pytest.fixture
def alice(api: Api, admin: Client) -> Iterator[User]:
    created = admin.users.create("alice")
    with Client(api.url, created.api_key) as client:
        yield User(created.user.id, created.api_key, client)


@dataclass
class DrivenJob:
    """A job whose learner published v0, trained step 0 on a worker's rollouts, and published v1."""

    id: str
    folder: Path
    worker_id: str
    rollout_ids: list[str]
    learner: httpx.Client

    def finish(self) -> None:
        ok(self.learner.post(f"/v1/jobs/{self.id}/learner/finish",
                             json={"outcome": "succeeded", "final_version": 1}))


def drive_job(api: Api, job_id: str, folder: Path) -> DrivenJob:
    learner = learner_for(api, job_id)
    ok(learner.post(f"/v1/jobs/{job_id}/learner/start"))
    publish(learner, job_id, folder, version=0, step=0)
    _, provider = new_provider(api)
    worker_id, worker = new_worker(api, provider)
    activate(api, worker_id, job_id)
    lease = ok(worker.post("/v1/leases", json={"job_id": job_id, "max_prompts": 2, "version": 0}), 201)
    ids = [ok(submit_group(worker, lease, p, 0))["results"][0]["rollout_id"] for p in lease["prompts"]]
    ok(learner.post(f"/v1/jobs/{job_id}/learner/claim", json={"step": 0, "max_groups": 10}))
    report = {"step": 0, "rollout_ids": ids, "t_train_s": 0.1, "reward_mean": 0.5, "reward_std": 0.1,
              "loss": 0.2, "kl": 0.0, "clip_frac": 0.0, "staleness_hist": [1, 1], "tokens": 12,
              "rewards": [{"rollout_id": i, "rewards": [1.0, 0.0]} for i in ids]}
    ok(learner.post(f"/v1/jobs/{job_id}/learner/steps", json=report))
    publish(learner, job_id, folder, version=1, step=1)
    return DrivenJob(job_id, folder, worker_id, ids, learner)


@pytest.fixture
def driven(api: Api, alice: User, tmp_path: Path) -> Iterator[DrivenJob]:
    job = alice.client.jobs.create(SPEC)
    folder = fake_model_folder(tmp_path / "model")
    driven = drive_job(api, job.id, folder)
    yield driven
    driven.learner.close()


@pytest.fixture(scope="session")
def _stub_server() -> Iterator[StubServer]:
    server = StubServer().start()
    yield server
    server.stop()


@pytest.fixture
def stub(_stub_server: StubServer) -> StubServer:
    """A scripted local HTTP server (no database): set its replies with `stub.reply(...)`."""
    _stub_server.reply(Reply(500))
    return _stub_server
