"""Weight publication in a background thread, so training never waits for serialisation or upload.
A version is announced by the control plane only after every chunk arrived and matched.

Each version is published in full (a keyframe: the first, every `keyframe_every`-th, the final one)
and/or as a delta against the version published before it (echo2.deltas): workers that hold that one
fetch only what changed. The learner keeps the last published folder on disk as the next delta's base.

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
from dataclasses import dataclass
from pathlib import Path

import torch
from echo2.deltas import Folder, build_delta, files_digest
from echo2.possession import draw_probes
from echo2.protocol import AdapterInfo, Manifest, WeightsConfig
from echo2.snapshots import DEFAULT_CHUNK_SIZE, build_manifest

from .sources import WeightSink
from .weights import Role, Weights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    version: int
    step: int
    state: dict[str, torch.Tensor]  # Weights.snapshot(): a CPU copy in the published dtype (never mutated)
    final: bool  # the job's last version: published in full whatever the count since the last keyframe


class Publisher:
    """Publishes versions in the background: each in full (a keyframe) and/or as a delta against the one
    published before it (WeightsConfig: delta, keyframe_every); a LoRA job's adapters always in full. The
    last published folder stays on disk as the next delta's base."""

    def __init__(self, plane: WeightSink, weights: Weights, work_dir: Path, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 config: WeightsConfig | None = None) -> None:
        self.plane, self.weights = plane, weights
        self.work_dir, self.chunk_size = work_dir, chunk_size
        self.config = config or WeightsConfig()
        self.published: int | None = None
        self.submitted: int | None = None
        self.skipped: list[int] = []
        self.seconds: list[float] = []
        self.sizes: list[tuple[int, int | None, int | None]] = []  # (version, full bytes, delta bytes)
        self._base: Folder | None = None  # the last published version's folder, the next delta's base
        self._first_digest: str | None = None  # of version 0's files: a LoRA job's adapters apply to it
        self._since_keyframe = 0
        self._pending: Snapshot | None = None
        self._busy = self._closed = False
        self._changed = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self._thread.start()

    def submit(self, version: int, step: int, state: dict[str, torch.Tensor], final: bool = False) -> None:
        """Publish `state` (a Weights.snapshot()) in the background."""
        self._raise_if_failed()
        with self._changed:
            if self._pending is not None:
                self.skipped.append(self._pending.version)
                log.info("version %d replaced by version %d before it was published", self._pending.version, version)
                final = final or self._pending.final
            self._pending, self.submitted = Snapshot(version, step, state, final), version
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
                    self._publish(item)
            except BaseException as exc:  # surfaced to the training thread on its next call
                log.exception("publishing version %s failed", item.version)
                self._error = exc
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()

    def _next(self) -> Snapshot | None:
        with self._changed:
            self._changed.wait_for(lambda: self._pending is not None or self._closed)
            item, self._pending = self._pending, None
            self._busy = item is not None
            return item

    def _publish(self, snap: Snapshot) -> None:
        start = time.perf_counter()
        role = role_of(snap.version, snap.final)
        folder = self.work_dir / f"v{snap.version}"
        self.weights.write(snap.state, folder, role)
        full = build_manifest(folder, snap.version, snap.step, self.chunk_size)
        if role is Role.first:
            self._first_digest = files_digest(full.target_files())
        elif self.weights.lora and role is Role.next:
            full = full.model_copy(update={"adapter": AdapterInfo(base_version=0, base_digest=self._digest_of_first())})
        target = Folder(snap.version, folder, full.target_files())
        delta = None if self.weights.lora else self._delta(target, snap.step, full.total_size)
        keyframe = delta is None or snap.final or self._since_keyframe + 1 >= self.config.keyframe_every
        forms = ([(folder, full)] if keyframe else []) + ([delta] if delta is not None else [])
        self.plane.publish(forms, draw_probes(folder, target.files, self._base))  # workers prove they hold it
        self._since_keyframe = 0 if keyframe else self._since_keyframe + 1
        if delta is not None:
            shutil.rmtree(delta[0], ignore_errors=True)
        if self._base is not None:
            shutil.rmtree(self._base.path, ignore_errors=True)
        self._base, self.published = target, snap.version
        self.seconds.append(time.perf_counter() - start)
        self.sizes.append((snap.version, full.total_size if keyframe else None,
                           delta[1].total_size if delta else None))
        log.info("published version %d (step %d) in %.2fs: %s", snap.version, snap.step, self.seconds[-1],
                 ", ".join(f"{m.form.value} {m.total_size / 1e6:.2f} MB" for _, m in forms))

    def _digest_of_first(self) -> str:
        if self._first_digest is None:  # a resumed learner: version 0 was published by its predecessor
            self._first_digest = files_digest(self.plane.version_files(0))
        return self._first_digest

    def _delta(self, target: Folder, step: int, full_size: int) -> tuple[Path, Manifest] | None:
        """The delta against the last published version, when deltas are on and it is worth sending (at
        most half the full form's bytes; otherwise the version goes out in full)."""
        if self._base is None or not self.config.delta:
            return None
        out = self.work_dir / f"d{target.version}"
        shutil.rmtree(out, ignore_errors=True)
        manifest = build_delta(self._base, target, out, step, self.chunk_size)
        if manifest is None or manifest.total_size * 2 > full_size:
            shutil.rmtree(out, ignore_errors=True)
            return None
        return out, manifest


def role_of(version: int, final: bool) -> Role:
    """What a version is in its job: the first (a LoRA job's base), the final one, or one in between."""
    return Role.first if version == 0 else Role.final if final else Role.next
