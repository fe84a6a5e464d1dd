"""A `verifiers` environment (examples/verifiers_guess, the classic API of verifiers 0.3) served by
learner/verifiers_host.py in its own venv, played by real workers through the control plane as an
`http_env` job on the tiny model: the episodes' turns and rewards are the environment's.

Slow: the first run builds .venv-verifiers (scripts/setup_verifiers_venv.sh, ~700 MB)."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from echo2 import Client
from sqlalchemy import select

from api.db import Database
from api.models import Rollout
from api.settings import Settings
from server.local import free_port
from server.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-verifiers"


@pytest.fixture(scope="module")
def verifiers_python() -> Path:
    subprocess.run(["bash", str(REPO / "scripts/setup_verifiers_venv.sh")], check=True)
    return VENV / "bin/python"


def host(python: Path, *args: str, **popen) -> subprocess.Popen | subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'examples/verifiers_guess'}:{REPO}", "HF_HUB_OFFLINE": "1"}
    argv = [str(python), "-m", "learner.verifiers_host", "--env-id", "echo2_guess_env", *args]
    if popen:
        return subprocess.Popen(argv, env=env, **popen)
    return subprocess.run(argv, env=env, check=True, capture_output=True, text=True)


def test_a_verifiers_environment_is_played_end_to_end(tmp_path, verifiers_python):
    items = tmp_path / "prompts.jsonl"
    host(verifiers_python, "--env-args", '{"size": 64}', "--export-prompts", str(items))
    port = free_port()
    server = host(verifiers_python, "--env-args", '{"size": 64}', "--port", str(port), stdout=subprocess.PIPE,
                  text=True)
    settings = Settings(data_dir=tmp_path / ".echo2", port=free_port())
    try:
        assert "listening" in server.stdout.readline()
        stack = Stack(settings, workers=2).start()
        try:
            with Client(base_url=stack.url, api_key=stack.admin_key) as client:
                job = client.jobs.create({
                    "name": "verifiers", "base_model": "echo2:tiny", "max_steps": 3, "staleness": 1,
                    "task": {"name": "http_env", "params": {"url": f"http://127.0.0.1:{port}/step", "max_turns": 3,
                                                            "concurrency": 1}},
                    "prompts": [{"item": json.loads(line)} for line in items.read_text().splitlines()],
                    "grpo": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 3}})
                deadline = time.monotonic() + 600
                while not (final := client.jobs.get(job.id)).status.is_terminal():
                    assert time.monotonic() < deadline, "timed out"
                    stack.supervise()
                    time.sleep(1)
        finally:
            stack.stop()
    finally:
        server.terminate()
    assert final.status.value == "succeeded", final.status_reason
    with Database(settings.database_url).session() as s:
        trained = list(s.scalars(select(Rollout).where(Rollout.job_id == job.id, Rollout.status == "trained")))
    assert len({r.trained_step for r in trained}) == 3
    samples = [(sample, reward) for r in trained for sample, reward in zip(r.samples, r.rewards, strict=True)]
    assert all(reward in (0.0, 1.0) for _, reward in samples)
    assert any(len(sample["turns"]) > 1 for sample, _ in samples), "no episode lasted past its first turn"

