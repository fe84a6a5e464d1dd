"""Version notices: a thread that long-polls the control plane for the next version of the worker's job
(GET /v1/jobs/{id}/versions/next) and, when one is announced, makes the worker heartbeat at once — the
reply carries the new assignment (relay parents and key), and the download starts without waiting for
the next heartbeat interval. The heartbeat stays the fallback: a failed poll only backs off."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from echo2 import errors
from echo2.protocol import VersionNotice

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
        # What notices said, until the worker's own view (`watching`, from its heartbeat replies) catches up:
        # asked again with what it knew, the control plane answers at once with the same news, and the poll
        # turned into a busy loop of requests (and log lines) until the heartbeat's reply came.
        announced: dict[str, int] = {}
        ended: set[str] = set()
        while not self._stop.is_set():
            target = self.watching()
            if target is None or target[0] in ended:
                self._stop.wait(1.0)
                continue
            job_id, known = target
            try:
                notice = self.control.wait_for_version(job_id, max(known, announced.get(job_id, known)), POLL_S)
            except errors.Echo2Error as exc:
                log.debug("version notice poll failed (%s); the heartbeat still brings news", exc)
                self._stop.wait(RETRY_S)
                continue
            if notice.changed and not self._stop.is_set():
                self._news(notice, announced, ended)

    def _news(self, notice: VersionNotice, announced: dict[str, int], ended: set[str]) -> None:
        if notice.job_status.is_terminal():
            log.info("job %s %s", notice.job_id, notice.job_status.value)
            ended.add(notice.job_id)
        else:
            log.info("version %s of job %s announced", notice.version, notice.job_id)
            if notice.version is not None:
                announced[notice.job_id] = notice.version
        self.on_news()
