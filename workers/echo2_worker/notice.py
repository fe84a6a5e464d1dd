"""Version notices: a thread that long-polls the control plane for the next version of the worker's job
(GET /v1/jobs/{id}/versions/next) and, when one is announced, makes the worker heartbeat at once — the
reply carries the new assignment (relay parents and key), and the download starts without waiting for
the next heartbeat interval. The heartbeat stays the fallback: a failed poll only backs off."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from echo2 import errors

from .control import ControlPlane

log = logging.getLogger(__name__)
POLL_S = 25.0  # how long one long-poll waits on the server
RETRY_S = 5.0


class VersionWatcher:
    def __init__(self, control: ControlPlane, watching: Callable[[], tuple[str, int] | None],
                 on_news: Callable[[], None]) -> None:
        """`watching` gives (job id, the newest version the worker knows of), or None when it has no job."""
        self.control, self.watching, self.on_news = control, watching, on_news
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="echo2-notice", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            target = self.watching()
            if target is None:
                self._stop.wait(1.0)
                continue
            job_id, known = target
            try:
                notice = self.control.wait_for_version(job_id, known, POLL_S)
            except errors.Echo2Error as exc:
                log.debug("version notice poll failed (%s); the heartbeat still brings news", exc)
                self._stop.wait(RETRY_S)
                continue
            if notice.changed and not self._stop.is_set():
                log.info("version %s of job %s announced", notice.version, job_id)
                self.on_news()
