"""Weight publication in a background thread, so training never waits for serialisation or upload.
A version is announced by the control plane only after every chunk arrived and matched.

At most one snapshot waits. A version submitted while an older one is still waiting (not yet being
published) replaces it: the older version is never published, and is logged and counted in
`skipped`. Version numbers keep their meaning — version v is always the weights after step v — so a
skipped number simply does not exist; versions stay strictly increasing, which is all the control
plane requires (`api/routes/weights.py` accepts any version newer than the last), and workers are
told the newest version. Memory stays bounded at two CPU copies of the weights (one being published,
one waiting) however far training runs ahead of publication.

The thread runs at normal priority. At nice 10 it slowed training less on a shared core
(bench/publish_overlap.py), but in the live loop it then took most of a step to publish each version,
workers fell behind, and the learner waited for rollouts: with it at normal priority, learner
utilisation went from about 80 % to 99 % (bench/live_loop.py; docs/BENCHMARKS.md, Live loop).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
from echo2.snapshots import DEFAULT_CHUNK_SIZE, build_manifest

from .remote import ControlPlane

log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, plane: ControlPlane, model: Any, tokenizer: Any, work_dir: Path,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        self.plane, self.model, self.tokenizer = plane, model, tokenizer
        self.work_dir, self.chunk_size = work_dir, chunk_size
        self.published: int | None = None
        self.submitted: int | None = None
        self.skipped: list[int] = []
        self.seconds: list[float] = []
        self._pending: tuple[int, int, dict[str, torch.Tensor]] | None = None
        self._busy = self._closed = False
        self._changed = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self._thread.start()

    def submit(self, version: int, step: int, state: dict[str, torch.Tensor]) -> None:
        """Publish `state` (a CPU copy of the weights, see parallel.Solo.model_state) in the background."""
        self._raise_if_failed()
        with self._changed:
            if self._pending is not None:
                self.skipped.append(self._pending[0])
                log.info("version %d replaced by version %d before it was published", self._pending[0], version)
            self._pending, self.submitted = (version, step, state), version
            self._changed.notify_all()

    def wait(self) -> None:
        """Block until everything submitted is published (or raise the publishing error)."""
        with self._changed:
            self._changed.wait_for(lambda: self._error is not None or (self._pending is None and not self._busy))
        self._raise_if_failed()

    def close(self) -> None:
        """Publish what is still waiting, then stop the thread."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join(timeout=60)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"publishing a weight version failed: {self._error}") from self._error

    def _run(self) -> None:
        while (item := self._next()) is not None:
            try:
                if self._error is None:
                    self._publish(*item)
            except BaseException as exc:  # surfaced to the training thread on its next call
                log.exception("publishing version %s failed", item[0])
                self._error = exc
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()

    def _next(self) -> tuple[int, int, dict[str, torch.Tensor]] | None:
        with self._changed:
            self._changed.wait_for(lambda: self._pending is not None or self._closed)
            item, self._pending = self._pending, None
            self._busy = item is not None
            return item

    def _publish(self, version: int, step: int, state: dict[str, torch.Tensor]) -> None:
        start = time.perf_counter()
        folder = self.work_dir / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)
        self.model.save_pretrained(folder, state_dict=state, safe_serialization=True)
        self.tokenizer.save_pretrained(folder)
        manifest = build_manifest(folder, version, step, self.chunk_size)
        self.plane.publish(folder, manifest)
        shutil.rmtree(folder, ignore_errors=True)
        self.published = version
        self.seconds.append(time.perf_counter() - start)
        log.info("published version %d (step %d) in %.2fs", version, step, self.seconds[-1])

