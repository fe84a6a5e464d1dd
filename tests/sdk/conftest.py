"""SDK fixtures: SDK clients against the real control plane (`api`), and a job driven through a step."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from echo2 import Client

from tests.conftest import ADMIN_KEY, Api
from tests.factories import DrivenJob, drive_job, fake_model_folder

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


@pytest.fixture
def driven(api: Api, alice: User, tmp_path: Path) -> Iterator[DrivenJob]:
    job = alice.client.jobs.create(SPEC)
    folder = fake_model_folder(tmp_path / "model")
    driven = drive_job(api, job.id, folder, staleness_hist=[1, 1])
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
