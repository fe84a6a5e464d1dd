"""Where a learner runs: N slots on one live learner host (hosts.py), on GPUs that hold its memory need.

A job needs max(1, learner.gpus) slots, all on one host (its torchrun group is one machine). On a host
with GPUs a slot is a GPU, and the job's learner sees only its slots' GPUs; a job that computes on a GPU
(device auto or cuda) goes only to GPUs of at least its `learner_memory_gib` (estimated at submission,
api/services/memory.py). A job asking for GPUs runs on a host with GPUs wherever one is live (a CPU host
would run it as CPU processes); a job that uses no GPU goes to a CPU host first. Among the hosts where it
fits, its previous slots are taken when free (its checkpoint is on that host), else the host where it fits
tightest, so that wide holes stay for wide jobs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from api.models import Job, LearnerHost


@dataclass
class Placement:
    """A host, its slots there, and (on a host with GPUs) those slots' GPU ids (CUDA_VISIBLE_DEVICES)."""

    host: str
    slots: list[int]
    devices: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "slots": self.slots, "devices": self.devices}


@dataclass
class Room:
    """One live host's slots this tick and which of them are taken."""

    host: str
    slots: int
    gpus: list[dict[str, Any]]  # slot i's GPU; [] on a CPU host
    taken: set[int] = field(default_factory=set)

    def free(self, need_gib: float | None = None) -> list[int]:
        """Its free slots; with `need_gib`, only those whose GPU holds it (every slot of a CPU host)."""
        return [i for i in range(self.slots) if i not in self.taken
                and (need_gib is None or not self.gpus or self.gpus[i]["memory_gib"] >= need_gib)]

    def largest(self, n: int) -> float:
        """GiB that n of its GPUs each hold at least (its n-th largest); 0 with fewer than n."""
        sizes = sorted((g["memory_gib"] for g in self.gpus[:self.slots]), reverse=True)
        return sizes[n - 1] if len(sizes) >= n else 0.0


@dataclass
class Line:
    """The learner slots of one tick, host by host, and who holds them."""

    rooms: list[Room]
    holders: Counter[str] = field(default_factory=Counter)  # owner id -> jobs holding slots

    @classmethod
    def of(cls, hosts: list[LearnerHost]) -> Line:
        return cls([Room(h.name, h.slots, list(h.gpus or [])[:h.slots]) for h in hosts if h.slots > 0])

    @property
    def slots(self) -> int:
        return sum(r.slots for r in self.rooms)

    @property
    def free(self) -> int:
        return sum(len(r.free()) for r in self.rooms)

    def place(self, job: Job) -> Placement | None:
        """Its slots where they are free (module docstring), or None."""
        n = slots_of(job)
        fits = [(r, free) for r in self._pool(job) if len(free := r.free(_need(job))) >= n]
        if not fits:
            return None
        before = job.learner_placement or {}
        for room, free in fits:
            if room.host == before.get("host") and len(before["slots"]) == n and set(before["slots"]) <= set(free):
                return _placement(room, sorted(before["slots"]))
        room, free = min(fits, key=lambda rf: (bool(rf[0].gpus) and not on_gpu(job), len(rf[1]), rf[0].host))
        return _placement(room, free[:n])

    def take(self, placement: Placement) -> None:
        for room in self.rooms:
            if room.host == placement.host:
                room.taken.update(placement.slots)

    def hold(self, job: Job) -> None:
        """A live learner keeps its slots (one launched before placements were recorded takes some now)."""
        placed = job.learner_placement
        placement = self.place(job) if placed is None else \
            Placement(placed["host"], list(placed["slots"]), list(placed.get("devices", [])))
        if placement is not None:
            self.take(placement)
        self.holders[job.owner_id] += 1

    def why_not(self, job: Job) -> str:
        """What a job that `place` could not place waits for."""
        if not self.rooms:
            return "no learner host is up (start one: echo2-server learner-host)"
        n, need, pool = slots_of(job), _need(job), self._pool(job)
        what = f"its {n}-GPU learner" if n > 1 else "its learner"
        widest = max(r.slots for r in pool)
        if widest < n:
            kind = "GPU" if any(r.gpus for r in pool) else "slot"
            return f"{what} needs {n} slots on one host; the largest live host has {widest} {kind}(s)"
        sized = need is not None and all(r.gpus for r in pool)
        if sized and all(r.largest(n) < need for r in pool):
            best = max(r.largest(n) for r in pool)
            return (f"{what} needs {need:.1f} GiB on each of {n} GPU(s) of one host; no live learner host has "
                    f"{n} GPU(s) that large (the largest: {best:.1f} GiB)")
        if not self.free:
            return f"every learner slot is busy ({self.slots} of {self.slots})"
        most = max(len(r.free(need)) for r in pool)
        large = f" of at least {need:.1f} GiB" if sized else ""
        return (f"{what} needs {n} free slot(s){large} on one host (the most free on one host: {most}; "
                f"{self.free} of {self.slots} free in all)")

    def _pool(self, job: Job) -> list[Room]:
        """The hosts it may run on: a job asking for GPUs runs on GPUs wherever a live host has any."""
        if wants_gpus(job) and any(r.gpus for r in self.rooms):
            return [r for r in self.rooms if r.gpus]
        return self.rooms


def _placement(room: Room, slots: list[int]) -> Placement:
    return Placement(room.host, slots, [str(room.gpus[i]["id"]) for i in slots] if room.gpus else [])


def slots_of(job: Job) -> int:
    """Slots its learner holds: one a GPU (torchrun, one process a GPU), one at least."""
    return max(1, int(job.spec.get("learner", {}).get("gpus", 0)))


def wants_gpus(job: Job) -> bool:
    """It asked for GPUs (learner.gpus >= 1, device not cpu)."""
    return int(job.spec.get("learner", {}).get("gpus", 0)) >= 1 and on_gpu(job)


def on_gpu(job: Job) -> bool:
    """On a host with GPUs it computes on its slots' GPUs (device auto or cuda)."""
    return job.spec.get("learner", {}).get("device", "auto") != "cpu"


def _need(job: Job) -> float | None:
    """GiB each of its GPUs must hold, when it computes on them and the need is known."""
    return job.learner_memory_gib if on_gpu(job) else None
