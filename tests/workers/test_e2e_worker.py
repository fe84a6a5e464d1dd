"""End to end, as a provider would do it: `pip install ./sdk './workers[cpu]'` into a fresh venv, then
`echo2-worker join` as a real process against a live control plane running a tiny-model job. It must
produce accepted rollouts, and SIGTERM must drain it with no lease left to expire."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from sqlalchemy import select

from api.models import Lease
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
