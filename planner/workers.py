"""The fleet as the solver reads it: every known worker's profile, indexed by id, with the marks (price,
liveness) that the churn and price triggers compare between solves."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import overload

from .capacity import WorkerProfile

Mark = tuple[float, bool]


def mark(worker: WorkerProfile) -> Mark:
    """What a solve remembers of a worker to see it churn or change its price."""
    return (worker.price_per_h, worker.alive)


class WorkerTable(Sequence[WorkerProfile]):
    """Every known worker's profile, in the caller's order. `decide` builds one from a list. A caller that
    keeps one across reconcile steps and replaces only the profiles that changed (the simulator) makes a
    step cheap on a large fleet: the marks follow each replacement and the table knows whether any moved
    since the fingerprint it last gave, so a quiet step reads only the workers serving a job; and a
    profile whose price and liveness stand can be rebuilt only when it is next read, for a step that
    re-solves."""

    def __init__(self, profiles: Iterable[WorkerProfile]) -> None:
        self._rows = list(profiles)
        self._row_of = {w.worker_id: i for i, w in enumerate(self._rows)}
        self._marks = {w.worker_id: mark(w) for w in self._rows}
        self._later: dict[int, Callable[[int], WorkerProfile]] = {}  # rows to rebuild when read, and how
        self._given: dict[str, Mark] | None = None  # the marks in the last fingerprint
        self._moved = False  # some mark changed since

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> WorkerProfile: ...
    @overload
    def __getitem__(self, i: slice) -> list[WorkerProfile]: ...
    def __getitem__(self, i: int | slice) -> WorkerProfile | list[WorkerProfile]:
        if isinstance(i, slice):
            return list(self)[i]
        if i in self._later:
            self._rebuild(i)
        return self._rows[i]

    def __iter__(self) -> Iterator[WorkerProfile]:
        for i in list(self._later):
            self._rebuild(i)
        return iter(self._rows)

    def profile(self, worker_id: str) -> WorkerProfile:
        """The worker's profile (KeyError for a worker the table does not hold)."""
        return self[self._row_of[worker_id]]

    def get(self, worker_id: str) -> WorkerProfile | None:
        return self.profile(worker_id) if worker_id in self._row_of else None

    def replace(self, i: int, profile: WorkerProfile) -> None:
        """Row i gets its worker's new profile."""
        if profile.worker_id != self._rows[i].worker_id:
            raise ValueError(f"row {i} is worker {self._rows[i].worker_id}, not {profile.worker_id}")
        self._rows[i] = profile
        self._later.pop(i, None)
        new = mark(profile)
        if new != self._marks[profile.worker_id]:
            self._marks[profile.worker_id] = new
            self._moved = True

    def replace_later(self, rows: Iterable[int], build: Callable[[int], WorkerProfile]) -> None:
        """Each row i gets `build(i)` when it is next read: for new profiles with the same price and liveness."""
        self._later.update(dict.fromkeys(rows, build))

    def _rebuild(self, i: int) -> None:
        profile = self._later.pop(i)(i)
        if mark(profile) != self._marks[profile.worker_id]:
            raise ValueError(f"{profile.worker_id}: a new price or liveness takes replace(), not replace_later()")
        self.replace(i, profile)

    def marks(self) -> dict[str, Mark]:
        """Every worker's mark, for a fingerprint; moves are counted from here."""
        self._given, self._moved = dict(self._marks), False
        return self._given

    def marks_differ(self, marks: dict[str, Mark]) -> bool:
        """Whether any worker's mark differs from `marks` (a fingerprint's): at once when they are the
        marks this table gave and nothing moved since, else worker by worker."""
        if marks is self._given and not self._moved:
            return False
        return self._marks != marks
