"""The learner's two outside dependencies, as small interfaces: where its rollouts come from (a
`RolloutSource`: claim groups for a step, report the trained step) and where its weights go (a
`WeightSink`: publish a version's forms). `learner.remote.ControlPlane` implements both over HTTP, with
the control plane; `LocalRollouts` and `LocalWeights` implement them in process, for tests and
benchmarks that drive the learner's parts (pipeline.py, publisher.py) without one."""

from __future__ import annotations

import shutil
import threading
from collections import deque
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol, runtime_checkable

from echo2.protocol import (
    ClaimedGroup,
    FileRef,
    Form,
    JobSpec,
    JobStatus,
    LearnerBatch,
    Manifest,
    Probe,
    StepAck,
    StepReport,
    VersionRead,
)


@runtime_checkable
class RolloutSource(Protocol):
    def claim(self, step: int, max_groups: int, wait_s: float = 0.0) -> LearnerBatch:
        """Up to `max_groups` groups admissible at `step`, waiting up to `wait_s` while there are none."""
        ...

    def report(self, report: StepReport) -> StepAck:
        """Commit a trained step: its groups are consumed, the ones it rejected refused."""
        ...


@runtime_checkable
class WeightSink(Protocol):
    def publish(self, forms: list[tuple[Path, Manifest]], probes: list[Probe] | None = None) -> VersionRead | None:
        """Publish a version's forms together (full and/or delta: a folder and its manifest each) with the
        secret probes workers prove possession by (echo2.possession); None when that version or a newer one
        is already published."""
        ...

    def version_files(self, version: int) -> list[FileRef]:
        """The model files a published version stands for, whichever form it was published in."""
        ...


class LocalRollouts:
    """A RolloutSource in process. Groups `put` here are claimed oldest first; one too old for the step
    claimed (`JobSpec.admissible`) is dropped as stale, one newer than the step waits. Each report is kept
    in `reports` and acknowledged as the control plane would: stop once `spec.max_steps` are committed."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.reports: list[StepReport] = []
        self._queued: deque[ClaimedGroup] = deque()
        self._ready = threading.Condition()

    def put(self, groups: Iterable[ClaimedGroup]) -> None:
        with self._ready:
            self._queued.extend(groups)
            self._ready.notify_all()

    def claim(self, step: int, max_groups: int, wait_s: float = 0.0) -> LearnerBatch:
        with self._ready:
            self._ready.wait_for(lambda: self._queued, timeout=wait_s)
            taken: list[ClaimedGroup] = []
            later: list[ClaimedGroup] = []
            stale = 0
            while self._queued and len(taken) < max_groups:
                group = self._queued.popleft()
                if self.spec.admissible(step, group.version):
                    taken.append(group)
                elif group.version > step:
                    later.append(group)
                else:
                    stale += 1
            self._queued.extendleft(reversed(later))
        return LearnerBatch(step=step, groups=taken, rejected_stale=stale)

    def report(self, report: StepReport) -> StepAck:
        with self._ready:
            self.reports.append(report)
        committed = report.step + 1
        return StepAck(step=committed, job_status=JobStatus.running, stop=committed >= self.spec.max_steps)


class LocalWeights:
    """A WeightSink in process: each form published is copied to `root/v<version>/<form>` (the publisher
    deletes its own folders) and recorded, as the control plane records it, in `versions`; its probes in
    `probes`."""

    def __init__(self, root: Path, job_id: str = "local") -> None:
        self.root, self.job_id = root, job_id
        self.versions: list[VersionRead] = []
        self.probes: dict[int, list[Probe]] = {}
        self._manifests: dict[int, dict[Form, Manifest]] = {}

    def publish(self, forms: list[tuple[Path, Manifest]], probes: list[Probe] | None = None) -> VersionRead | None:
        first = forms[0][1]
        if self.versions and self.versions[-1].version >= first.version:
            return None
        for folder, manifest in forms:
            shutil.copytree(folder, self.root / f"v{first.version}" / manifest.form.value)
        self.probes[first.version] = list(probes or [])
        by_form = self._manifests[first.version] = {m.form: m for _, m in forms}
        full, delta = by_form.get(Form.full), by_form.get(Form.delta)
        read = VersionRead(
            job_id=self.job_id, version=first.version, step=first.step, adapter=first.adapter is not None,
            total_size=full.total_size if full else None, num_chunks=len(full.chunks) if full else None,
            delta_size=delta.total_size if delta else None,
            delta_base=delta.delta.base_version if delta and delta.delta else None, created_at=datetime.now(UTC))
        self.versions.append(read)
        return read

    def version_files(self, version: int) -> list[FileRef]:
        forms = self._manifests[version]
        return (forms.get(Form.full) or forms[Form.delta]).target_files()
