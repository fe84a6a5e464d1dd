"""End to end, as a provider would do it: `pip install ./sdk './workers[cpu]'` into a fresh venv, then
`echo2-worker join` as a real process against a live control plane running a tiny-model job. It must
produce accepted rollouts, and SIGTERM must drain it with no lease left to expire. And as README says it:
`pip install --index-url http://CONTROL_PLANE/simple 'echo2-worker[cpu]'` from the control plane of
`echo2-server up`, with no source tree anywhere near, gives a worker that joins and trains a job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest
from echo2 import Client
from sqlalchemy import select

from api.db import Database
from api.models import Lease, Rollout
from api.services.packages import VERSION
from api.settings import Settings
from server.local import free_port
from server.stack import Stack
from tests.conftest import Api
from tests.factories import activate

from .conftest import rollouts, start_job, wait_for, worker_row

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
def worker_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with only the two distributions a provider installs (built once per session)."""
    root = tmp_path_factory.mktemp("worker-venv") / "venv"
    venv.EnvBuilder(with_pip=True).create(root)
    pip = subprocess.run([str(root / "bin" / "pip"), "install", "--quiet", str(REPO / "sdk"),
                          f"{REPO / 'workers'}[cpu]"], capture_output=True, text=True, timeout=1800)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    return root


@pytest.mark.postgres_only  # its SQLite twin runs with -m slow: CI's time budget
def test_pip_installed_worker_joins_produces_accepted_rollouts_and_drains(
        api: Api, tiny_model_dir: Path, worker_venv: Path, tmp_path: Path) -> None:
    exe = worker_venv / "bin" / "echo2-worker"
    probe = subprocess.run([str(worker_venv / "bin" / "python"), "-c", "import echo2_worker, echo2; "
                            "print(echo2_worker.__file__)"], capture_output=True, text=True, check=True, timeout=60)
    assert str(worker_venv) in probe.stdout  # the installed copy, not this checkout
    assert subprocess.run([str(exe), "--help"], capture_output=True, timeout=30).returncode == 0

    setup = start_job(api, tiny_model_dir)
    log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [str(exe), "--config-dir", str(tmp_path / "config"), "join", "--server", api.url, "--token",
         setup.provider_token, "--name", "e2e-worker", "--price-per-hour", "0.1", "--relay-port", "0",
         "--relay-host", "127.0.0.1", "--max-upload-mbps", "200", "--data-dir", str(tmp_path / "data"), "--json"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        def mine() -> list[dict]:
            items = api.admin.get("/v1/workers", params={"limit": 500}).json()["items"]
            return [w for w in items if w["name"] == "e2e-worker"]

        worker = wait_for(mine, 300, "the worker to register (bench included)")[0]
        assert worker["rollouts_per_s"] > 0 and worker["relay_url"].startswith("http://127.0.0.1:")
        activate(api, worker["id"], setup.id)
        accepted = wait_for(lambda: rollouts(api, setup.id, "accepted"), 300, "accepted rollouts")
        assert {r["worker_id"] for r in accepted} == {worker["id"]} and {r["version"] for r in accepted} == {0}
        wait_for(lambda: worker_row(api, worker["id"])["version_held"] == 0, 30, "version_held in a heartbeat")

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    with api.db.session() as s:
        left = s.scalars(select(Lease).where(Lease.worker_id == worker["id"], Lease.status == "active")).all()
    assert left == []
    assert worker_row(api, worker["id"])["status"] == "deregistered"
    lines = [json.loads(x) for x in (tmp_path / "worker.log").read_text().splitlines() if x.startswith("{")]
    assert any("deregistered" in x["msg"] for x in lines)
    assert setup.provider_token not in (tmp_path / "worker.log").read_text()
    sys.stdout.write(f"\ne2e worker log: {len(lines)} JSON lines\n")


def test_a_worker_pip_installed_from_the_control_planes_index_joins_and_trains(tmp_path: Path) -> None:
    # The index sends no one upstream here: the worker's dependencies come from the indexes of pip's own
    # configuration (pip.conf's extra-index-url), as they would from PyPI on a machine that reaches it.
    settings = Settings(data_dir=tmp_path / ".echo2", port=free_port(), package_upstream="", log_level="WARNING")
    stack = Stack(settings, workers=0).start()
    log_path = tmp_path / "worker.log"
    proc = None
    try:
        root = tmp_path / "provider" / "venv"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        venv.EnvBuilder(with_pip=True).create(root)
        pip = subprocess.run([str(root / "bin" / "pip"), "install", "--quiet", "--index-url", f"{stack.url}/simple",
                              "echo2-worker[cpu]"], capture_output=True, text=True, timeout=1800, env=env,
                             cwd=tmp_path / "provider")
        assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
        where = subprocess.run([str(root / "bin" / "python"), "-c", "import echo2, echo2_worker; "
                                "print(echo2.__file__, echo2_worker.__file__)"], capture_output=True, text=True,
                               check=True, env=env, cwd=tmp_path / "provider").stdout
        assert where.count(str(root / "lib")) == 2, where  # both from the index, installed in the venv

        with Client(base_url=stack.url, api_key=stack.admin_key) as client:
            token = client.providers.create("pip-provider").token
            job = client.jobs.create(name="from-the-index", base_model="echo2:tiny", task="arithmetic",
                                     max_steps=3, staleness=1, eval={"size": 0},
                                     grpo={"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 6})
            with log_path.open("w") as log:
                proc = subprocess.Popen(
                    [str(root / "bin" / "echo2-worker"), "--config-dir", str(tmp_path / "config"), "join",
                     "--server", stack.url, "--name", "pip-worker", "--gpus", "none", "--relay-port", "0",
                     "--relay-host", "127.0.0.1", "--data-dir", str(tmp_path / "data"), "--json"],
                    stdout=log, stderr=subprocess.STDOUT, env={**env, "ECHO2_PROVIDER_TOKEN": token},
                    cwd=tmp_path / "provider")
            deadline = time.monotonic() + 600
            while not (final := client.jobs.get(job.id)).status.is_terminal():
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, f"job still {final.status} at step {final.step}"
                stack.supervise()
                time.sleep(1)
        assert final.status.value == "succeeded" and final.step == 3, final.status_reason
        with Database(settings.database_url).session() as s:
            trained = list(s.scalars(select(Rollout).where(Rollout.job_id == job.id, Rollout.status == "trained")))
        workers = {w.id: w.name for w in client_workers(stack)}
        assert trained and {workers[r.worker_id] for r in trained} == {"pip-worker"}
        assert f"the control plane runs Echo2 {VERSION}, as this worker does" in log_path.read_text()
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        stack.stop()


def client_workers(stack: Stack) -> list:
    with Client(base_url=stack.url, api_key=stack.admin_key) as client:
        return client.workers.list(limit=500).items
