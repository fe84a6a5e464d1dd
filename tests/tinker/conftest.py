"""Fixtures of the Tinker tests: the SDK's venv (skipped when absent) and a Tinker learner host process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ADMIN_KEY, Api
from tests.factories import new_user

ROOT = Path(__file__).resolve().parents[2]
TINKER_PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
HOST_PRICE = 3.6  # $/h: a cent per 10 s of compute


@pytest.fixture(scope="session")
def tinker_python() -> Path:
    return tinker_sdk_python()


def tinker_sdk_python() -> Path:
    """The interpreter of the venv holding the official `tinker` SDK (scripts/setup_tinker_venv.sh)."""
    # Skipped where the venv is absent; in CI (scripts/test.sh builds it) a missing SDK is a failure.
    missing = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
    if not TINKER_PYTHON.exists():
        missing("the tinker SDK venv is absent: run scripts/setup_tinker_venv.sh")
    check = subprocess.run([str(TINKER_PYTHON), "-c", "import tinker"], capture_output=True, timeout=120)
    if check.returncode != 0:
        missing(f"tinker does not import in {TINKER_PYTHON}: run scripts/setup_tinker_venv.sh")
    return TINKER_PYTHON


@pytest.fixture(scope="session")
def host_work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tinker-host")  # built-in models are built once per run


@pytest.fixture
def host_slots() -> int:
    return 2  # a test module may override it


@pytest.fixture
def tinker_host(api: Api, host_work_dir: Path, tmp_path: Path, host_slots: int) -> Iterator[subprocess.Popen]:
    log = (tmp_path / "host.log").open("w")
    cmd = [sys.executable, "-m", "learner.tinker.host", "--server", api.url, "--name", "test-host",
           "--slots", str(host_slots), "--threads", "1", "--device", "cpu", "--work-dir", str(host_work_dir),
           "--price-per-hour", str(HOST_PRICE)]
    process = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "ECHO2_API_KEY": ADMIN_KEY}, stdout=log,
                               stderr=subprocess.STDOUT)
    yield process
    process.terminate()
    process.wait(timeout=30)
    log.close()


@pytest.fixture
def user_key(api: Api) -> str:
    _, client = new_user(api, "tinkerer")
    return client.headers["Authorization"].split()[1]
