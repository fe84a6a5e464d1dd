"""What the worker is doing, for people (one refreshing terminal line) and machines (JSON log lines).

`Stats` is the shared, thread-safe tally the loop, the downloader and the relay write to; the
heartbeat sends a `WorkerStats` built from it. Tokens never reach a log: `JsonFormatter` and
`PlainFormatter` scrub anything shaped like an Echo2 token or a bearer header.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from typing import IO, Any

from echo2 import logs
from echo2.protocol import WorkerStats

from .ratelimit import RateMeter

_SECRET = re.compile(r"(e2[uplw]_[A-Za-z0-9_\-]{6,}|Bearer\s+\S+)")


def scrub(text: str) -> str:
    return _SECRET.sub("[redacted]", text)


class Stats:
    def __init__(self) -> None:
        self.state = "starting"
        self.job_id: str | None = None
        self.version_loaded: int | None = None
        self.version_held: int | None = None
        self.leases_done = 0
        self.rollouts_accepted = 0
        self.rollouts_rejected = 0
        self.last_download_s: float | None = None
        self.tokens = RateMeter(window=30.0)
        self.groups = RateMeter(window=30.0)
        self.download = RateMeter(window=5.0)
        self.upload = RateMeter(window=5.0)
        self.lock = threading.Lock()

    def worker_stats(self) -> WorkerStats:
        return WorkerStats(
            rollouts_done=self.rollouts_accepted, tokens_per_s=self.tokens.rate(),
            upload_bytes_per_s=self.upload.rate(), download_bytes_per_s=self.download.rate(),
            last_download_s=self.last_download_s,
        )

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": self.state, "job_id": self.job_id, "version_loaded": self.version_loaded,
            "version_held": self.version_held, "leases_done": self.leases_done,
            "rollouts_accepted": self.rollouts_accepted, "rollouts_rejected": self.rollouts_rejected,
            "tokens_per_s": round(self.tokens.rate(), 1), "groups_per_s": round(self.groups.rate(), 3),
            "download_mb_s": round(self.download.rate() / 1e6, 2), "upload_mb_s": round(self.upload.rate() / 1e6, 2),
            "uploaded_mb": round(self.upload.total / 1e6, 1), "downloaded_mb": round(self.download.total / 1e6, 1),
        }

    def line(self) -> str:
        s = self.snapshot()
        version = "-" if s["version_loaded"] is None else f"v{s['version_loaded']}"
        if s["version_held"] is not None and s["version_held"] != s["version_loaded"]:
            version += f" (v{s['version_held']} on disk)"
        return (f"[{s['state']}] {version} | leases {s['leases_done']} | rollouts {s['rollouts_accepted']} ok"
                f" {s['rollouts_rejected']} rejected | {s['tokens_per_s']:.0f} tok/s"
                f" | down {s['download_mb_s']:.1f} MB/s up {s['upload_mb_s']:.1f} MB/s")


class ProgressReporter:
    """A daemon thread: a single refreshing line on a terminal, else a log record every `every` s."""

    def __init__(self, stats: Stats, stream: IO[str] | None = None, every: float = 10.0) -> None:
        self.stats = stats
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = 1.0 if self.tty else every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="echo2-progress", daemon=True)
        self._log = logging.getLogger("echo2_worker.progress")

    def start(self) -> ProgressReporter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            if self.tty:
                self.stream.write("\r\x1b[K" + self.stats.line()[:200])
                self.stream.flush()
            else:
                self._log.info(self.stats.line(), extra={"progress": self.stats.snapshot()})


class JsonFormatter(logs.JsonFormatter):
    """The JSON line of every Echo2 process (echo2.logs), scrubbed, with `progress` fields when present."""

    def fields(self, record: logging.LogRecord) -> dict[str, Any]:
        out = {k: scrub(v) if k in ("msg", "exc", "stack") else v for k, v in super().fields(record).items()}
        progress = getattr(record, "progress", None)
        if isinstance(progress, dict):
            out.update(progress)
        return out


class PlainFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        return scrub(super().format(record))


class _TtyAwareHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Clears the progress line before a log line so the two do not interleave."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(self.stream, "isatty", lambda: False)():
            self.stream.write("\r\x1b[K")
        super().emit(record)


def setup_logging(json_logs: bool, level: int = logging.INFO, stream: IO[str] | None = None) -> None:
    handler = _TtyAwareHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json_logs else PlainFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "urllib3", "filelock", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
