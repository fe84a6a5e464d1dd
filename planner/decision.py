"""What the solver decides and remembers: its settings, one decision per reconcile step with a one-line
explanation per worker, and the state the next decision starts from (JSON-serialisable)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum

from .capacity import JobProfile, WorkerProfile

METHODS = ("milp", "greedy", "all")


@dataclass(frozen=True, slots=True)
class SolverConfig:
    method: str = "milp"  # "milp" | "greedy" | "all"
    time_limit_s: float = 5.0  # per MILP solve
    mip_rel_gap: float = 1e-4
    min_dwell_s: float = 600.0
    drift: float = 0.10
    keep_bias: float = 0.05
    infeasible_retry_s: float = 300.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")


class Action(StrEnum):
    ACTIVATE = "activated"
    KEEP = "kept"
    DEACTIVATE = "deactivated"
    IDLE = "idle"
    SKIP = "skipped"


@dataclass(frozen=True, slots=True)
class WorkerDecision:
    worker_id: str
    action: Action
    job_id: str | None  # the job it serves after this decision (None when not serving)
    reason: str
    # For each other running job: why the worker does not serve it (IDLE: qualifies, not needed; SKIP:
    # the constraint it misses, or the job it serves instead), so every job can explain every worker.
    others: tuple[tuple[str, Action, str], ...] = ()

    def line(self) -> str:
        return f"{self.action} {self.worker_id}: {self.reason}"


@dataclass(frozen=True, slots=True)
class JobAllocation:
    job_id: str
    worker_ids: tuple[str, ...]
    throughput: float  # Σ μ of the assigned workers that qualify
    required: float  # (1 + h) R / T_train
    slack_s: float
    price_per_h: float
    feasible: bool
    reason: str
    predicted_utilisation: float


@dataclass(slots=True)
class SolverState:
    """What the next decision needs from this one; JSON-serialisable via to_dict/from_dict."""

    assignment: dict[str, str] = field(default_factory=dict)  # worker_id -> job_id
    activated_at: dict[str, float] = field(default_factory=dict)  # worker_id -> time
    qualified: dict[str, bool] = field(default_factory=dict)  # assigned worker -> fresh at solve
    solved_at: float = 0.0
    fingerprint: dict = field(default_factory=dict)  # inputs at the last solve
    infeasible_jobs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SolverState:
        fp = data.get("fingerprint") or {}
        return cls(
            assignment=dict(data.get("assignment", {})),
            activated_at={k: float(v) for k, v in data.get("activated_at", {}).items()},
            qualified={k: bool(v) for k, v in data.get("qualified", {}).items()},
            solved_at=float(data.get("solved_at", 0.0)),
            fingerprint={part: {k: tuple(v) for k, v in fp.get(part, {}).items()} for part in fp},
            infeasible_jobs=list(data.get("infeasible_jobs", [])),
        )


@dataclass(slots=True)
class Decision:
    at: float
    trigger: str  # why the set was (re)solved, or why it was kept
    resolved: bool
    method: str  # what produced the set: "milp", "greedy (fallback: ...)", "partial", "kept", ...
    jobs: tuple[JobAllocation, ...]
    workers: tuple[WorkerDecision, ...]
    state: SolverState
    job_inputs: tuple[JobProfile, ...]
    worker_inputs: tuple[WorkerProfile, ...]  # the profiles it read: every worker's on a re-solve, else the assigned
    solve_s: float = 0.0

    @property
    def assignment(self) -> dict[str, str]:
        return dict(self.state.assignment)

    def changes(self) -> list[WorkerDecision]:
        return [w for w in self.workers if w.action in (Action.ACTIVATE, Action.DEACTIVATE)]

    def lines(self) -> list[str]:
        return [w.line() for w in self.workers]

    def to_dict(self) -> dict:
        def worker_row(w: WorkerProfile) -> dict:
            row = asdict(w)
            row["backends"] = sorted(w.backends)
            row["perf_by_job"] = {k: asdict(v) for k, v in w.perf_by_job.items()}
            return row

        def job_row(j: JobProfile) -> dict:
            return {**asdict(j), "backends": sorted(j.backends)}

        return {
            "at": self.at,
            "trigger": self.trigger,
            "resolved": self.resolved,
            "method": self.method,
            "solve_s": self.solve_s,
            "jobs": [asdict(a) for a in self.jobs],
            "workers": [{**asdict(w), "line": w.line()} for w in self.workers],
            "state": self.state.to_dict(),
            "inputs": {
                "jobs": [job_row(j) for j in self.job_inputs],
                "workers": [worker_row(w) for w in self.worker_inputs],
            },
        }
