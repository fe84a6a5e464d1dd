"""Weight publication in a background thread, so training never waits for serialisation or upload.
A version is announced by the control plane only after every chunk arrived and matched."""

from __future__ import annotations

import logging
import queue
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
        self.seconds: list[float] = []
        self._queue: queue.Queue[tuple[int, int, dict[str, torch.Tensor]] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self._thread.start()

    def submit(self, version: int, step: int, state: dict[str, torch.Tensor]) -> None:
        """Publish `state` (a CPU copy of the weights, see parallel.Solo.model_state) in the background."""
        self._raise_if_failed()
        self._queue.put((version, step, state))
        self.submitted = version

    def wait(self) -> None:
        """Block until everything submitted is published (or raise the publishing error)."""
        self._queue.join()
        self._raise_if_failed()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"publishing a weight version failed: {self._error}") from self._error

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if self._error is None:
                    self._publish(*item)
            except BaseException as exc:  # surfaced to the training thread on its next call
                log.exception("publishing version %s failed", item[0])
                self._error = exc
            finally:
                self._queue.task_done()
        self._queue.task_done()

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
