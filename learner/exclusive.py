"""One learner of a job at a time on a learner host.

Two learners of one job on one host would share its work directory (checkpoints, model cache) and
undo each other's claims: a learner's start releases the job's claimed rollouts, so the other's next
step report is refused (409) and counted as a crash. Fencing by token keeps an *older* learner from
reporting, but it may still be running when its replacement arrives, and a broker can hand the same
launch over twice (the token is then the same, so fencing cannot tell them apart).

So a launch takes an exclusive lock on `<work_dir>/<job>.lock`, where the holder writes a digest of
its token: a launch that finds its own token there is a duplicate and returns at once; one with a
newer token waits for the older learner, which stops at its next call to the control plane (401).
The kernel drops the lock when its process dies, however it dies.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


@contextmanager
def sole_learner(work_dir: Path, job_id: str, token: str) -> Iterator[bool]:
    """Yield True holding the job's lock on this host, or False at once if this launch is a duplicate."""
    work_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(token.encode()).hexdigest()
    with open(work_dir / f"{job_id}.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            if lock.read().strip() == digest:
                log.warning("job %s: this launch is already running on this host; not starting it twice", job_id)
                yield False
                return
            log.info("job %s: waiting for the job's previous learner on this host to stop", job_id)
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.truncate(0)
        lock.write(digest)
        lock.flush()
        try:
            yield True
        finally:
            lock.truncate(0)
