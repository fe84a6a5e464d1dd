"""`pip install ./sdk` into a fresh virtual environment gives a working `echo2` with only httpx + pydantic."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SDK = Path(__file__).resolve().parents[2] / "sdk"


def test_sdk_installs_alone_and_starts_fast(tmp_path):
    # Build from a copy: an in-place build would write build/ and egg-info into the shared work tree.
    source = tmp_path / "sdk"
    shutil.copytree(SDK, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    venv = tmp_path / "venv"
    # Nothing of the calling environment may leak in: the fresh venv must stand on its own.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env, timeout=120)
    bin_dir = venv / "bin"
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", str(source)], check=True,
                   timeout=600, env=env)

    started = time.monotonic()
    help_run = subprocess.run([str(bin_dir / "echo2"), "--help"], capture_output=True, text=True, check=True,
                              env=env, timeout=60)
    assert time.monotonic() - started < 1.0
    assert "checkpoints" in help_run.stdout

    probe = ("import sys, echo2\n"
             "from echo2 import Client, AsyncClient, NotFoundError, protocol\n"
             "assert protocol.JobSpec and Client and AsyncClient and NotFoundError\n"
             "assert not {'torch', 'transformers', 'fastapi', 'sqlalchemy', 'api'} & set(sys.modules)\n"
             "print(echo2.__file__)")
    out = subprocess.run([str(bin_dir / "python"), "-c", probe], capture_output=True, text=True, check=True,
                         cwd=tmp_path, env=env).stdout
    assert str(venv) in out  # the installed copy, not the work tree
    freeze = subprocess.run([str(bin_dir / "python"), "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, check=True, env=env).stdout.lower()
    assert "torch" not in freeze and "fastapi" not in freeze
