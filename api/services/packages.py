"""The control plane as a package index (PEP 503): the `echo2` and `echo2-worker` wheels of its own version,
so a provider installs the worker from the platform it joins (pip's --index-url replaces its default index):

    pip install --index-url http://CONTROL_PLANE/simple 'echo2-worker[cpu]'

The wheels come from `ECHO2_WHEEL_DIR` when it holds them (the image builds them there), else they are built
once from the source tree the platform runs from (a checkout) into DATA_DIR/wheels, in a thread started by
the index's first request (which waits for it), under a file lock shared by every API process, and again
when the tree changed. Any other project's page is sent on to `ECHO2_PACKAGE_UPSTREAM` (PyPI by default),
so the worker's dependencies come from the usual index while `echo2` and `echo2-worker` can only come from
here; with the upstream empty, other names are 404 and pip takes them from the indexes of its own
configuration (`--extra-index-url`, pip.conf).
"""

from __future__ import annotations

import fcntl
import hashlib
import html
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
VERSION = "0.1.0"  # the platform's own (api.app): echo2-server, echo2 and echo2-worker are released together
PROJECTS = {"echo2": "sdk", "echo2-worker": "workers"}  # project -> its folder in the source tree
REQUIRES_PYTHON = ">=3.11"
SOURCE = Path(__file__).resolve().parents[2]  # the tree this platform runs from, when it is a checkout
BUILD_TIMEOUT_S = 600


def normalize(name: str) -> str:
    """PEP 503's normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(project: str, version: str = VERSION) -> str:
    return f"{project.replace('-', '_')}-{version}-py3-none-any.whl"


@dataclass(frozen=True)
class Wheel:
    project: str
    path: Path
    sha256: str


class WheelIndex:
    """The wheels this control plane serves, found or built once; `wheels()` is None while they are being built
    and `error` says why, when they could not be."""

    def __init__(self, given: Path | None, data_dir: Path) -> None:
        self.given, self.built = given, data_dir / "wheels"
        self.error: str | None = None
        self._wheels: dict[str, Wheel] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Find or build the wheels in the background (a build takes a few seconds)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._prepare, name="wheel-index", daemon=True)
                self._thread.start()

    def wait(self, timeout: float | None = None) -> dict[str, Wheel] | None:
        self.start()
        assert self._thread is not None
        self._thread.join(timeout)
        return self._wheels

    def _prepare(self) -> None:
        try:
            folder = self.given if self.given is not None else self.built
            if self.given is None:
                _build_locked(folder)
            if not _complete(folder):
                raise RuntimeError(f"{folder} lacks {', '.join(wheel_name(p) for p in PROJECTS)}")
            self._wheels = {p: Wheel(p, folder / wheel_name(p), _sha256(folder / wheel_name(p))) for p in PROJECTS}
        except Exception as exc:  # served as a 503 naming it; the API itself runs on
            self.error = f"{type(exc).__name__}: {exc}"[:500]
            log.error("the package index has no wheels: %s", self.error)


def _complete(folder: Path) -> bool:
    return all((folder / wheel_name(p)).is_file() for p in PROJECTS)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _build_locked(folder: Path) -> None:
    """Build both wheels into `folder` unless they were built from the tree as it is now (its digest in
    `.source`): once across the processes that share the folder, and again after the code changed."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = folder / ".source"
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            digest = tree_digest(SOURCE)
            if not (_complete(folder) and stamp.is_file() and stamp.read_text() == digest):
                build_wheels(SOURCE, folder)
                stamp.write_text(digest)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def tree_digest(source: Path) -> str:
    """sha256 over the paths and contents of the files the wheels are built from."""
    digest = hashlib.sha256()
    for folder in PROJECTS.values():
        for path in sorted((source / folder).rglob("*")):
            parts = set(path.relative_to(source).parts)
            if path.is_file() and not parts & {"build", "__pycache__"} and \
                    not any(p.endswith(".egg-info") for p in parts):
                digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def build_wheels(source: Path, out: Path) -> None:
    """`pip wheel` of sdk/ and workers/ from a copy of `source` (an in-place build would leave build/ and
    egg-info in the tree), with the setuptools of this environment (no download), into `out`."""
    missing = [d for d in PROJECTS.values() if not (source / d / "pyproject.toml").is_file()]
    if missing:
        raise RuntimeError(f"no source tree to build the wheels from ({source} has no {', '.join(missing)}/); "
                           "set ECHO2_WHEEL_DIR to a folder holding them (the image builds them there)")
    with tempfile.TemporaryDirectory(prefix="echo2-wheels-") as tmp:
        for folder in PROJECTS.values():
            shutil.copytree(source / folder, Path(tmp) / folder,
                            ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        staged = Path(tmp) / "out"
        cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
               "--no-index", "-w", str(staged), *(str(Path(tmp) / f) for f in PROJECTS.values())]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"pip wheel failed: {(done.stderr or done.stdout).strip()[-400:]}")
        for project in PROJECTS:
            built = staged / wheel_name(project)
            if not built.is_file():
                raise RuntimeError(f"pip wheel made no {built.name} (is {project} still at version {VERSION}?)")
            partial = out / f"{built.name}.tmp"
            shutil.copyfile(built, partial)
            os.replace(partial, out / built.name)  # a wheel appears whole or not at all
    log.info("built %s in %s", ", ".join(wheel_name(p) for p in PROJECTS), out)


def root_page() -> str:
    links = "\n".join(f'<a href="{p}/">{p}</a><br>' for p in PROJECTS)
    return f"<!DOCTYPE html>\n<html><head><title>Echo2 package index</title></head><body>\n{links}\n</body></html>\n"


def project_page(wheel: Wheel, files_prefix: str) -> str:
    name = wheel.path.name
    href = f"{files_prefix}/{name}#sha256={wheel.sha256}"
    return (f"<!DOCTYPE html>\n<html><head><title>Links for {wheel.project}</title></head><body>\n"
            f'<h1>Links for {wheel.project}</h1>\n<a href="{html.escape(href)}" '
            f'data-requires-python="{html.escape(REQUIRES_PYTHON)}">{name}</a><br>\n</body></html>\n')
