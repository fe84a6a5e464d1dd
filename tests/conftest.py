"""Shared fixtures: a real control plane over real HTTP, on SQLite and on PostgreSQL.

Every test that uses `api` runs twice, once per database. PostgreSQL is the one given in
ECHO2_TEST_POSTGRES_URL, or a private cluster started here; under CI=true a missing PostgreSQL is a
failure, elsewhere those runs are skipped.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from api.app import create_app
from api.auth import forget_all
from api.bootstrap import ensure_admin
from api.db import Database
from api.migrate import upgrade
from api.models import Base
from api.settings import Settings
from server.local import PostgresServer, find_pg_bin, free_port

ADMIN_KEY = "e2u_test-admin-key-0123456789abcdef0123456789"


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    given = os.environ.get("ECHO2_TEST_POSTGRES_URL")
    if given:
        yield given
        return
    if find_pg_bin() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("PostgreSQL is required in CI (the test script installs it)")
        pytest.skip("PostgreSQL not installed")
    with PostgresServer() as server:
        yield server.url


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    if request.param == "postgres":
        url = request.getfixturevalue("postgres_url")
    else:
        url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'echo2.db'}"
    upgrade(url)
    return url


PORT_TRIES = 5


@dataclass
class LiveServer:
    url: str
    settings: Settings
    db: Database
    app: object


@pytest.fixture(scope="session")
def live_server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # A free port can be taken by another process before uvicorn binds it (the other test process, a subprocess
    # test): 533 tests of one process once failed to set up on "address already in use". Another port is tried.
    for _ in range(PORT_TRIES):
        port = free_port()
        # retention_sweep_s=0: one sweep at start only; tests that need one run it themselves. Learners at $1/h:
        # the lowest a user may name (api/services/jobs.py check_terms), which the billing tests' arithmetic uses.
        settings = Settings(data_dir=tmp_path_factory.mktemp("data"), database_url=database_url, port=port,
                            lease_ttl_s=30, heartbeat_interval_s=1, retention_sweep_s=0, learner_price_per_hour=1.0)
        app = create_app(settings)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started and thread.is_alive():
            threading.Event().wait(0.02)
        if server.started:
            break
    else:
        raise RuntimeError(f"uvicorn failed to start on {PORT_TRIES} free ports")
    yield LiveServer(url=f"http://127.0.0.1:{port}", settings=settings, db=app.state.db, app=app)
    server.should_exit = True
    thread.join(timeout=10)


def _wipe(server: LiveServer) -> None:
    tables = [t.name for t in reversed(Base.metadata.sorted_tables)]
    for attempt in range(10):
        try:
            with server.db.engine.begin() as conn:
                if server.db.is_postgres:
                    conn.execute(text(f"TRUNCATE {', '.join(tables)} CASCADE"))
                else:
                    for name in tables:
                        conn.execute(text(f"DELETE FROM {name}"))
            break
        except OperationalError:
            # A request of the previous test (e.g. a browser page still polling) can hold a lock that
            # TRUNCATE must wait for; PostgreSQL then picks TRUNCATE as the deadlock victim. Retry.
            if attempt == 9:
                raise
            time.sleep(0.5)
    forget_all()  # tokens of the previous test are gone from the database
    shutil.rmtree(server.settings.blob_dir, ignore_errors=True)
    server.settings.blob_dir.mkdir(parents=True, exist_ok=True)


@dataclass
class Api:
    """A clean control plane for one test, with an admin client."""

    server: LiveServer
    admin: httpx.Client

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def db(self) -> Database:
        return self.server.db

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


@pytest.fixture
def api(live_server: LiveServer) -> Iterator[Api]:
    _wipe(live_server)
    ensure_admin(live_server.db, ADMIN_KEY)
    with httpx.Client(base_url=live_server.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                      timeout=30) as admin:
        yield Api(server=live_server, admin=admin)


def _swapped_while_loading() -> dict[tuple[object, str], object]:
    """What transformers swaps while it builds a model and puts back after: torch.nn.init's functions (and
    their imports in torch.nn's modules), torch.linspace and PreTrainedModel.tie_weights, as they are now."""
    import torch
    from transformers.initialization import TORCH_INIT_FUNCTIONS
    from transformers.modeling_utils import PreTrainedModel

    modules = [m for name, m in list(sys.modules.items()) if name.startswith("torch.nn")]
    watched = [(m, n) for m in modules for n in TORCH_INIT_FUNCTIONS if hasattr(m, n)]
    watched += [(torch, "linspace"), (PreTrainedModel, "tie_weights")]
    return {(owner, name): getattr(owner, name) for owner, name in watched}


@pytest.fixture(scope="session")
def _torch_as_imported() -> dict[tuple[object, str], object]:
    return _swapped_while_loading()


@pytest.fixture(autouse=True)
def _model_loading_left_torch_alone(_torch_as_imported) -> Iterator[None]:
    """A model built outside echo2.loading's lock, racing another thread's load, can leave transformers'
    stand-ins in place; every later load in this test process would then get parameters with no data, far
    from the cause. Fail the test that did it, and put torch's own functions back for the tests after it."""
    yield
    from echo2.loading import LOAD_LOCK

    with LOAD_LOCK:  # a load in flight has them swapped legitimately
        swapped = [(o, n, f) for (o, n), f in _torch_as_imported.items() if getattr(o, n) is not f]
        for owner, name, original in swapped:
            setattr(owner, name, original)
    assert not swapped, (f"{[n for _, n, _ in swapped]} left swapped: a model was built outside "
                         "echo2.loading's lock while another thread built one")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from learner.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Keeps CI inside its time budget: a long test marked postgres_only runs on SQLite only with -m slow.
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.get_closest_marker("postgres_only") and params.get("database_url") == "sqlite":
            item.add_marker(pytest.mark.slow)
