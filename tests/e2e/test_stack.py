"""The whole platform as a user runs it: `echo2-server demo` and `echo2-server up` as real process
trees (API, Celery scheduler + beat, Redis, learner host, local workers)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from api.db import Database
from api.models import EvalResult, Lease, Rollout
from server.local import free_port

pytestmark = pytest.mark.e2e
STALENESS = 2


def stack_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "ECHO2_DATA_DIR": str(tmp_path / ".echo2"), "ECHO2_LOG_LEVEL": "WARNING"}


def test_demo_learns_with_three_workers_and_keeps_the_invariants(tmp_path):
    done = subprocess.run([sys.executable, "-m", "server.cli", "demo", "--workers", "3", "--port", str(free_port()),
                           "--staleness", str(STALENESS)], env=stack_env(tmp_path), capture_output=True,
                          text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = next(line for line in done.stdout.splitlines() if line.startswith("succeeded: held-out accuracy"))
    first, last = map(float, re.search(r"training reward ([\d.]+) -> ([\d.]+)", summary).groups())
    assert first <= 0.2 and last >= 0.8, summary
    before, after = map(float, re.search(r"held-out accuracy ([\d.]+) -> ([\d.]+)", summary).groups())
    assert 0 <= before <= 1 and 0 <= after <= 1, summary  # measured; the figures are in docs/BENCHMARKS.md
    db = Database(f"sqlite:///{tmp_path / '.echo2' / 'echo2.db'}")
    with db.session() as s:
        trained = list(s.scalars(select(Rollout).where(Rollout.status == "trained")))
        leases = {lease.id: lease for lease in s.scalars(select(Lease))}
        evaluated = sorted(s.scalars(select(EvalResult.step)))
    assert evaluated == list(range(0, 131, 10)), evaluated  # before the first step, every 10 (eval.every), the last
    assert trained
    assert len({r.id for r in trained}) == len(trained)
    assert len({(r.prompt_id, r.trained_step) for r in trained}) == len(trained), "a prompt trained twice in a step"
    for r in trained:
        lease = leases[r.lease_id]
        assert lease.worker_id == r.worker_id and r.prompt_id in lease.prompt_ids, "rollout not from its lease"
        assert r.trained_step - r.version <= STALENESS
    assert {r.worker_id for r in trained}.__len__() >= 2, "the work was not spread over workers"
    assert not list((tmp_path / ".echo2" / "run").glob("*.pid"))


def test_a_second_up_in_its_folder_is_refused_and_ctrl_c_leaves_no_process_behind(tmp_path):
    """A second `up` (or demo) from the same data folder used to kill the running stack's processes as orphans
    and leave it broken; now it is refused and the running stack is untouched."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "up", "--workers", "1", "--port", str(port)],
                            env=stack_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    for line in proc.stdout:
        if line.startswith("Echo2 is up"):
            break
        assert time.monotonic() < deadline
    run = tmp_path / ".echo2" / "run"
    _tinker_host_serves(url, (tmp_path / ".echo2" / "admin.key").read_text().strip())
    groups = sorted(int(p.read_text()) for p in run.glob("*.pid"))
    assert len(groups) == 6  # redis, api, scheduler, learner host, Tinker host, one worker
    second = subprocess.run([sys.executable, "-m", "server.cli", "up", "--workers", "1", "--port", str(free_port())],
                            env=stack_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert second.returncode == 1 and f"a stack is already running from {tmp_path / '.echo2'}" in second.stderr \
        and url in second.stderr, second.stdout + second.stderr
    assert sorted(int(p.read_text()) for p in run.glob("*.pid")) == groups
    assert all(Path(f"/proc/{pid}").exists() and not zombie(pid) for pid in groups)
    assert httpx.get(f"{url}/v1/version", timeout=10).status_code == 200
    members = descendants(groups)
    assert len(members) >= len(groups)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    alive = [pid for pid in members if Path(f"/proc/{pid}").exists() and not zombie(pid)]
    assert alive == [], f"left behind: {alive}"
    assert not list(run.glob("*.pid")) and not (run / "up.owner").exists()


def test_a_signal_while_up_is_starting_leaves_no_process_behind(tmp_path):
    """SIGTERM (or Ctrl-C) while `up` is still starting its children stops what it started: they live in
    sessions of their own, so nothing else would."""
    env = stack_env(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "up", "--workers", "1", "--port", str(free_port())],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    run = tmp_path / ".echo2" / "run"
    deadline = time.monotonic() + 120
    while not (run / "scheduler.pid").exists():  # the API is up, the rest is starting
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert _ours(env["ECHO2_DATA_DIR"]) == [], "left behind"
    assert not list(run.glob("*.pid"))


def _ours(data_dir: str) -> list[int]:
    """Live processes started for this data directory (they inherit its ECHO2_DATA_DIR)."""
    mark = f"ECHO2_DATA_DIR={data_dir}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "environ").read_bytes().split(b"\0") and not zombie(
                    int(entry.name)):
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def _tinker_host_serves(url: str, key: str) -> None:
    """`up` runs a Tinker learner host: a LoRA model created over the Tinker routes gets loaded and billed."""
    tinker = httpx.Client(base_url=url, headers={"X-API-Key": f"tml-{key}"}, timeout=30)
    session = tinker.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    future = tinker.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                       "base_model": "echo2:tiny", "lora_config": {"rank": 2}}).json()
    deadline = time.monotonic() + 120
    while (answer := tinker.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]}).json()
           ).get("type") == "try_again":
        assert time.monotonic() < deadline, answer
    assert answer["model_id"] == future["model_id"], answer
    usage = httpx.get(f"{url}/v1/tinker/usage", headers={"Authorization": f"Bearer {key}"}).json()
    assert [(e["kind"], e["host"]) for e in usage["entries"]] == [("create_model", "local-tinker")]


def descendants(groups: list[int]) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) in groups:
                    pids.append(int(entry.name))
            except ProcessLookupError:
                pass
    return pids


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True
