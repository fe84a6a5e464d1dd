"""learner.tether: a command started through it stops when its starter dies (the learner host's
torchrun group must not outlive a host killed with SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from learner import tether

ROOT = Path(__file__).resolve().parents[2]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; it only waits to be reaped


def _start(tmp_path: Path, tethered: bool) -> tuple[subprocess.Popen, int]:
    """A starter process that launches a sleeper (through the tether or not) and then sleeps."""
    pidfile = tmp_path / f"sleeper-{tethered}.pid"
    sleeper = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    prefix = '[sys.executable, "-m", "learner.tether"]' if tethered else "[]"
    starter = textwrap.dedent(f"""
        import os, subprocess, sys, time
        env = {{**os.environ, {tether.PARENT_ENV!r}: str(os.getpid())}}
        subprocess.Popen({prefix} + [sys.executable, "-c", {sleeper!r}], env=env)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", starter], cwd=ROOT)
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text()):
        assert time.monotonic() < deadline, "the sleeper never started"
        time.sleep(0.05)
    return proc, int(pidfile.read_text())


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_tethered_command_stops_when_its_starter_is_killed(tmp_path):
    starter, sleeper = _start(tmp_path, tethered=True)
    assert _running(sleeper)
    starter.kill()
    starter.wait()
    assert _gone_within(sleeper, 10)


def test_without_the_tether_the_command_outlives_its_starter(tmp_path):
    starter, sleeper = _start(tmp_path, tethered=False)
    try:
        starter.kill()
        starter.wait()
        assert not _gone_within(sleeper, 1.5)  # the orphan the tether exists to prevent
    finally:
        os.kill(sleeper, signal.SIGKILL)


def test_a_starter_already_gone_means_the_command_never_runs(tmp_path):
    marker = tmp_path / "ran"
    env = {**os.environ, tether.PARENT_ENV: "1"}  # not our parent: as if it had died before the prctl
    done = subprocess.run([sys.executable, "-m", "learner.tether", sys.executable, "-c",
                           f"open({str(marker)!r}, 'w')"], cwd=ROOT, env=env, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM and not marker.exists()
