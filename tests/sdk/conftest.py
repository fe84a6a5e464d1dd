"""SDK fixtures: SDK clients against the real control plane (`api`), and a job driven through a step."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from echo2 import Client

from api.models import Job, StepMetric
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


def long_job(api: Api, alice: User, steps: int) -> str:
    """A job with `steps` steps of metrics, more than the server answers in one page (1,000 by default)."""
    job = alice.client.jobs.create({**SPEC, "name": "long-run", "max_steps": 5000})
    with api.db.session() as s:  # what the learner's step reports leave behind
        s.add_all(StepMetric(job_id=job.id, step=i, t_train_s=0.1, reward_mean=i / steps, groups=4,
                             groups_dropped=0, staleness_hist=[4], tokens=100, cost_usd=0.001 * i)
                  for i in range(steps))
        s.get_one(Job, job.id).step = steps
        s.commit()
    return job.id


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


class _QuietFiles(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # a request log on stderr would bury what a failing test captured


@pytest.fixture(scope="session")
def plain_http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a web server that is no Echo2 control plane: Python's file server on loopback, whose
    404 for /v1/... is an HTML page."""
    handler = partial(_QuietFiles, directory=str(tmp_path_factory.mktemp("www")))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
