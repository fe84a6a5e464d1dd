"""What keeps the learner's core busy: the round trips to the control plane overlap training.

While step t trains,
- the report of step t - 1 goes out (`Committer`, one background thread, reports in order), and once
  it is acknowledged the version it made is published and
- the rollouts of step t + 1 are claimed (`ClaimAhead`; the control plane accepts claims one step
  ahead of the steps it has committed, for rollouts admissible at that step).
So after training step t the learner finds the next batch already claimed and the previous report
already answered, and starts step t + 1 at once: the control plane's latency leaves the critical path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from echo2.protocol import ClaimedGroup, StepAck, StepReport

from .sources import RolloutSource

log = logging.getLogger(__name__)
AHEAD_WAIT_S = 0.25  # a claim ahead waits this long for rollouts; the step then waits for it to answer


class Committer:
    """Step reports in the background, one at a time and in order. After a report is acknowledged,
    `then(ack)` runs in the committer's thread."""

    def __init__(self, plane: RolloutSource) -> None:
        self.plane = plane
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner-commit")
        self._last: Future[StepAck] | None = None

    def submit(self, report: StepReport, then: Callable[[StepAck], None]) -> None:
        def run() -> StepAck:
            ack = self.plane.report(report)
            then(ack)
            return ack

        self._last = self._pool.submit(run)

    def then(self, call: Callable[[], object], what: str) -> None:
        """Run `call` after the reports submitted so far (e.g. an evaluation of a step, which the control
        plane takes once the step is committed); a failure is logged, never fatal."""
        def run() -> None:
            try:
                call()
            except Exception as exc:
                log.warning("%s failed: %s", what, exc)

        self._pool.submit(run)

    def wait(self) -> StepAck | None:
        """The newest report's acknowledgement once it is in (its error, if it failed); None before any."""
        return self._last.result() if self._last is not None else None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class ClaimAhead(threading.Thread):
    """Claims for one step in the background, until it has `want` groups or is taken. Every group it
    claimed is handed over by `take` (it stops only between claims)."""

    def __init__(self, plane: RolloutSource, step: int, want: int) -> None:
        super().__init__(name=f"learner-claim-ahead-{step}", daemon=True)
        self.plane, self.step, self.want = plane, step, want
        self.groups: list[ClaimedGroup] = []
        self._taken = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            while not self._taken.is_set() and len(self.groups) < self.want:
                self.groups += self.plane.claim(self.step, self.want - len(self.groups), wait_s=AHEAD_WAIT_S).groups
        except Exception as exc:  # e.g. the job ended meanwhile: the step's own claims will say so
            log.info("claiming ahead for step %d stopped: %s", self.step, exc)

    def take(self) -> list[ClaimedGroup]:
        self._taken.set()
        self.join()
        return self.groups


class Ahead:
    """The claims-ahead in flight, by step: started from the committer's thread, taken by the trainer's. The claims
    for step t + 1 begin once step t has all its groups (`collected`), not when the ack of step t - 1 allows them
    (`start`), which often comes while step t still claims: begun then, they took the groups step t waited for (at an
    epoch's end, before the pool started the next epoch early, the job stalled for good)."""

    def __init__(self, plane: RolloutSource, want: int) -> None:
        self.plane, self.want = plane, want
        self._by_step: dict[int, ClaimAhead] = {}
        self._lock = threading.Lock()
        self._allowed = self._collected = -1  # the newest step claims may be made for; the newest with its groups

    def start(self, step: int) -> None:
        """The control plane takes claims for `step` now: they begin once the step before it has its groups."""
        with self._lock:
            self._allowed = max(self._allowed, step)
            self._begin()

    def collected(self, step: int) -> None:
        """`step` has all its groups: the claims for the one after it take nothing it waits for."""
        with self._lock:
            self._collected = max(self._collected, step)
            self._begin()

    def _begin(self) -> None:
        step = self._allowed
        if step == self._collected + 1 and step not in self._by_step:
            self._by_step[step] = ClaimAhead(self.plane, step, self.want)

    def held(self) -> dict[int, list[ClaimedGroup]]:
        """What the claims in flight hold so far, by step: groups that may be audited before their step starts.
        A worker on probation gets no more work while its groups wait for their verdicts, so groups claimed
        ahead must not wait for their step to be judged (while the step before waits for that worker)."""
        with self._lock:
            claims = list(self._by_step.values())
        return {claim.step: list(claim.groups) for claim in claims}

    def take(self, step: int) -> list[ClaimedGroup]:
        """What was claimed ahead for `step` (nothing if no claim ran for it)."""
        with self._lock:
            claim = self._by_step.pop(step, None)
        return claim.take() if claim is not None else []

    def close(self) -> None:
        """Stop every claim in flight; what they claimed is released when the job resumes or ends."""
        with self._lock:
            claims, self._by_step = list(self._by_step.values()), {}
        for claim in claims:
            claim.take()
