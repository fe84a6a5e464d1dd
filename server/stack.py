"""`echo2-server up`: the whole platform as one process tree on the embedded defaults.

A private Redis, the API (one process, or N behind its port on PostgreSQL), the scheduler (Celery worker
+ beat), one learner host (two learner slots by default), a Tinker learner host when asked (`up` asks for
one: the Tinker API, docs/TINKER.md) and N local CPU workers, each in its own process group with a pid
file under DATA_DIR/run.
Ctrl-C (or SIGTERM) stops them all: TERM to every group, then KILL to whatever is left, so no process
outlives `up`. Pid files left by an `up` that was itself killed are used to clean up its orphans at the
next start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from api.bootstrap import first_run_admin
from api.db import Database
from api.migrate import upgrade
from api.settings import Settings

from .local import RedisServer, check_port_free, free_port, wait_port

STOP_GRACE_S = 20.0
OWNER = "up.owner"  # in the run folder: the pid and URL of the `up` (or demo) whose children the pid files name


@dataclass
class Child:
    name: str
    args: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0


@dataclass
class Stack:
    settings: Settings
    workers: int = 2
    learner_slots: int = 2
    tinker_slots: int = 0  # models the Tinker learner host holds at once (0: no Tinker host)
    api_processes: int = 1  # uvicorn processes behind the one port (more than 1: PostgreSQL)
    children: list[Child] = field(default_factory=list)
    stop_signal: int = 0  # set by `hold_signals`' handler: start() and serve_forever end at their next step
    redis: RedisServer | None = None
    admin_key: str = ""
    owner: bool = False  # this stack claimed its run folder (claim_run_dir): its pid files are its own

    @property
    def url(self) -> str:
        return self.settings.public_url

    @property
    def run_dir(self) -> Path:
        return self.settings.data_dir / "run"

    def start(self) -> Stack:
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(exist_ok=True)
        claim_run_dir(self.run_dir, self.url)
        self.owner = True
        kill_orphans(self.run_dir)
        check_port_free(self.settings.host, self.settings.port)
        upgrade(self.settings.database_url)
        first_run_admin(Database(self.settings.database_url), self.settings.data_dir)
        self.admin_key = (self.settings.data_dir / "admin.key").read_text().strip()
        self.redis = RedisServer(data_dir=self.settings.data_dir / "redis").start()
        _write_pid(self.run_dir / "redis.pid", self.redis.proc.pid if self.redis.proc else 0)
        env = self._env()
        self._spawn(Child("api", [sys.executable, "-m", "server.cli", "api", "--workers", str(self.api_processes)],
                          env))
        wait_port(self.settings.port, timeout=120, proc=self.children[0].proc)
        self._spawn(Child("scheduler", [sys.executable, "-m", "server.cli", "scheduler"], env))
        self._spawn(Child("learner-host", [sys.executable, "-m", "server.cli", "learner-host",
                                           "--slots", str(self.learner_slots)], env))
        if self.tinker_slots > 0:
            self._spawn(Child("tinker-host", self._tinker_host_args(), {**env, "ECHO2_API_KEY": self.admin_key}))
        for _ in range(self.workers):
            self.add_worker()
        return self

    def _tinker_host_args(self) -> list[str]:
        """The Tinker learner host (learner/tinker/host.py), billing at the default learner price."""
        s = self.settings
        return [sys.executable, "-m", "learner.tinker.host", "--server", self.url, "--name", "local-tinker",
                "--slots", str(self.tinker_slots), "--threads", str(s.learner_threads or 1), "--device", "cpu",
                "--work-dir", str(s.data_dir / "tinker"), "--price-per-hour", str(s.learner_price_per_hour)]

    def add_worker(self, python: str = sys.executable, backend: str = "transformers") -> Child:
        """Start one more local CPU worker (its own process group and pid file); `python` is the
        interpreter of the environment it runs in (the vLLM backend needs vLLM's)."""
        i = sum(1 for c in self.children if c.name.startswith("worker-"))
        child = Child(f"worker-{i}", [python, *self._worker_args(i, self._provider_token(), backend)],
                      {**self._env(), "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
        self._spawn(child)
        return child

    def _env(self) -> dict[str, str]:
        s = self.settings
        return {**os.environ, "ECHO2_DATA_DIR": str(s.data_dir), "ECHO2_DATABASE_URL": s.database_url,
                "ECHO2_REDIS_URL": self.redis.url if self.redis else "", "ECHO2_HOST": s.host,
                "ECHO2_PORT": str(s.port), "ECHO2_PUBLIC_URL": s.public_url,
                "ECHO2_LEARNER_THREADS": str(s.learner_threads or 1), "PYTHONUNBUFFERED": "1"}

    def _provider_token(self) -> str:
        saved = self.settings.data_dir / "provider.token"
        if saved.exists():
            return saved.read_text().strip()
        r = httpx.post(f"{self.url}/v1/providers", json={"name": "local machine"},
                       headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=30)
        r.raise_for_status()
        token = r.json()["token"]
        fd = os.open(saved, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token)
        return token

    def _worker_args(self, i: int, token: str, backend: str) -> list[str]:
        home = self.settings.data_dir / "workers" / str(i)
        return ["-m", "echo2_worker.cli", "--config-dir", str(home / "config"), "join",
                "--server", self.url, "--token", token, "--name", f"local-{i}", "--price-per-hour", "0.05",
                "--backend", backend, "--device", "cpu", "--data-dir", str(home / "versions"),
                "--relay-host", "127.0.0.1", "--relay-port", str(free_port()), "--no-bench", "--json"]

    def _spawn(self, child: Child) -> None:
        if self.stop_signal:  # asked to stop while starting: start nothing more (the caller stops the rest)
            raise SystemExit(128 + self.stop_signal)
        log = open(self.run_dir / f"{child.name}.log", "ab")  # noqa: SIM115 (kept open for the child)
        child.proc = subprocess.Popen(child.args, env=child.env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        _write_pid(self.run_dir / f"{child.name}.pid", child.proc.pid)
        if child not in self.children:
            self.children.append(child)

    def supervise(self, max_restarts: int = 5) -> None:
        """Restart a child that died on its own (a crash is logged in its log file)."""
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None and child.restarts < max_restarts:
                child.restarts += 1
                self._spawn(child)

    def stop(self) -> None:
        for child in self.children:
            _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children:
            if child.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            _signal_group(child.proc, signal.SIGKILL)
            if child.proc is not None:
                child.proc.wait()
        if self.redis is not None:
            self.redis.stop()
        if not self.owner:  # refused to start (another stack runs from this folder): its files are not ours
            return
        for pid_file in self.run_dir.glob("*.pid"):
            pid_file.unlink()
        (self.run_dir / OWNER).unlink(missing_ok=True)


def _write_pid(path: Path, pid: int) -> None:
    path.write_text(str(pid))


def _signal_group(proc: subprocess.Popen[bytes] | None, sig: int) -> None:
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the child leads its own group: its own children go too


def claim_run_dir(run_dir: Path, url: str) -> None:
    """Make this process the owner of the run folder's children, or refuse while another `up` that owns them
    still runs: starting would kill its processes as orphans (kill_orphans) and leave it broken."""
    owner = run_dir / OWNER
    pid, running_url = _owner(owner)
    if pid is not None:
        raise RuntimeError(f"a stack is already running from {run_dir.parent} (process {pid}, {running_url}): use "
                           f"it, or stop it first (Ctrl-C where it runs, or kill {pid}); to run a second one "
                           "beside it, give it a data folder of its own (ECHO2_DATA_DIR) and another --port")
    owner.write_text(f"{os.getpid()} {url}")


def _owner(path: Path) -> tuple[int | None, str]:
    """The live process that owns the folder and its URL; (None, "") where none does (no file, or its process
    is gone: an `up` that died without cleaning up, whose children kill_orphans then ends)."""
    try:
        pid_text, _, url = path.read_text().partition(" ")
        pid = int(pid_text)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (ValueError, OSError):
        return None, ""
    ours = b"echo2" in cmdline or b"server.cli" in cmdline  # not a recycled pid now running something else
    return (pid, url) if ours and pid != os.getpid() else (None, "")


def kill_orphans(run_dir: Path) -> None:
    """Kill what an earlier `up` that died without cleaning up left behind (only our own processes:
    a recycled pid belonging to something else is left alone)."""
    for pid_file in run_dir.glob("*.pid"):
        try:
            pid = int(pid_file.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"echo2" in cmdline or b"server.cli" in cmdline or b"redis-server" in cmdline:
                os.killpg(pid, signal.SIGKILL)
        except (ValueError, OSError):
            pass
        pid_file.unlink()


def serve_forever(stack: Stack) -> None:
    """Block until Ctrl-C or SIGTERM, supervising the children; the caller stops the stack. A signal only marks
    the stack (`hold_signals`), so none lands while supervise() restarts a child."""
    with contextlib.suppress(SystemExit), hold_signals(stack):
        while not stack.stop_signal:
            stack.supervise()
            time.sleep(0.5)


@contextlib.contextmanager
def hold_signals(stack: Stack) -> Iterator[None]:
    """While starting or serving: Ctrl-C and SIGTERM only mark the stack as stopping, so no exception lands
    between a child's fork and its being recorded (that child would outlive `stop`); start() ends at its next
    child, serve_forever at its next look, and leaving this block raises what the signal would have."""
    def mark(signum: int, _: object) -> None:
        stack.stop_signal = signum

    before = {sig: signal.signal(sig, mark) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    if stack.stop_signal:
        raise SystemExit(128 + stack.stop_signal)


def exit_on_sigterm() -> None:
    """For a script that runs a Stack inside try/finally: SIGTERM raises SystemExit like Ctrl-C raises
    KeyboardInterrupt, so the `finally` that stops the stack runs instead of leaving its children behind."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
