"""Simulator results: per-job figures, costs, activation decisions, and a printable table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from planner.decision import Decision
from planner.sim.state import LEASED, JobState


@dataclass(frozen=True, slots=True)
class LeaseReturn:
    worker_id: str
    job_id: str
    killed_at: float
    returned_at: float
    prompts: int


@dataclass(frozen=True, slots=True)
class DecisionSummary:
    at: float
    trigger: str
    method: str
    solve_s: float
    active: dict[str, int]  # job -> workers
    throughput: dict[str, float]
    required: dict[str, float]
    feasible: dict[str, bool]
    price_per_h: dict[str, float]
    activated: int
    deactivated: int
    lines: tuple[str, ...]  # activations and deactivations, one line each

    @classmethod
    def of(cls, d: Decision) -> DecisionSummary:
        changes = d.changes()
        return cls(
            at=d.at,
            trigger=d.trigger,
            method=d.method,
            solve_s=d.solve_s,
            active={a.job_id: len(a.worker_ids) for a in d.jobs},
            throughput={a.job_id: a.throughput for a in d.jobs},
            required={a.job_id: a.required for a in d.jobs},
            feasible={a.job_id: a.feasible for a in d.jobs},
            price_per_h={a.job_id: a.price_per_h for a in d.jobs},
            activated=sum(1 for c in changes if c.action == "activated"),
            deactivated=sum(1 for c in changes if c.action == "deactivated"),
            lines=tuple(c.line() for c in changes),
        )


@dataclass(frozen=True, slots=True)
class JobResult:
    job_id: str
    completed: bool
    steps: int
    wall_s: float  # submission to last step
    busy_s: float  # learner computing
    utilisation: float  # busy / wall, pipeline fill included
    steady_utilisation: float  # busy / (last step − first step start)
    dropped_stale: int
    prompts_total: int
    prompts_consumed: int
    prompts_lost: int
    learner_cost: float
    worker_cost: float
    activations: int
    deactivations: int
    peak_active: int

    @classmethod
    def of(cls, job: JobState, end: float) -> JobResult:
        """The job's figures when the simulation ends at `end`; every prompt not in a known state is lost."""
        spec = job.spec
        finished = job.finished_at if job.finished_at is not None else end
        wall = max(0.0, finished - spec.submit_at_s)
        leased = sum(1 for s in job.state if s == LEASED)
        accounted = job.consumed + len(job.pool) + len(job.ready) + leased
        steady = finished - job.first_step_at if job.first_step_at is not None else 0.0
        return cls(
            job_id=spec.job_id,
            completed=job.done,
            steps=job.step,
            wall_s=wall,
            busy_s=job.busy_s,
            utilisation=job.busy_s / wall if wall else 0.0,
            steady_utilisation=job.busy_s / steady if steady else 0.0,
            dropped_stale=job.dropped,
            prompts_total=len(job.state),
            prompts_consumed=job.consumed,
            prompts_lost=len(job.state) - accounted,
            learner_cost=spec.learner_price_per_h * wall / 3600,
            worker_cost=job.worker_cost,
            activations=job.activations,
            deactivations=job.deactivations,
            peak_active=job.peak_active,
        )


@dataclass(slots=True)
class SimResult:
    scenario: str
    method: str
    n_workers: int
    sim_s: float
    runtime_s: float  # wall-clock seconds the simulation took
    cpu_s: float  # CPU seconds it took (less sensitive to a busy machine)
    jobs: list[JobResult]
    worker_hours: float
    resolves: int
    ticks: int
    decisions: list[DecisionSummary]
    kills: list[tuple[float, str]]
    lease_returns: list[LeaseReturn]
    full_decisions: list[Decision] = field(default_factory=list, repr=False)

    @property
    def cost_learner(self) -> float:
        return sum(j.learner_cost for j in self.jobs)

    @property
    def cost_workers(self) -> float:
        return sum(j.worker_cost for j in self.jobs)

    @property
    def cost_total(self) -> float:
        return self.cost_learner + self.cost_workers

    @property
    def prompts_lost(self) -> int:
        return sum(j.prompts_lost for j in self.jobs)

    def to_dict(self, max_lines: int = 20) -> dict:
        decisions = []
        for d in self.decisions:
            row = asdict(d)
            row["lines"] = list(d.lines[:max_lines])
            row["lines_omitted"] = max(0, len(d.lines) - max_lines)
            decisions.append(row)
        return {
            "scenario": self.scenario,
            "method": self.method,
            "n_workers": self.n_workers,
            "sim_s": self.sim_s,
            "runtime_s": self.runtime_s,
            "cpu_s": self.cpu_s,
            "cost": {"learner": self.cost_learner, "workers": self.cost_workers, "total": self.cost_total},
            "worker_hours": self.worker_hours,
            "prompts_lost": self.prompts_lost,
            "resolves": self.resolves,
            "ticks": self.ticks,
            "jobs": [asdict(j) for j in self.jobs],
            "kills": len(self.kills),
            "lease_returns": [asdict(r) for r in self.lease_returns],
            "decisions": decisions,
        }

    def table(self, max_lines: int = 8) -> str:
        w = max([16, *(len(j.job_id) + 1 for j in self.jobs)])
        out = [
            f"scenario {self.scenario}: {self.n_workers} workers, solver {self.method}, "
            f"simulated {self.sim_s / 3600:.2f} h in {self.runtime_s:.1f} s ({self.cpu_s:.1f} s CPU)",
            "",
            f"{'job':<{w}}{'done':>5}{'steps':>7}{'wall h':>8}{'util':>7}{'steady':>8}"
            f"{'dropped':>9}{'lost':>6}{'peak A':>7}{'learner $':>11}{'workers $':>11}",
        ]
        for j in self.jobs:
            out.append(
                f"{j.job_id:<{w}}{'yes' if j.completed else 'no':>5}{j.steps:>7}{j.wall_s / 3600:>8.2f}"
                f"{j.utilisation:>7.1%}{j.steady_utilisation:>8.1%}{j.dropped_stale:>9}{j.prompts_lost:>6}"
                f"{j.peak_active:>7}{j.learner_cost:>11.2f}{j.worker_cost:>11.2f}"
            )
        out += [
            "",
            f"cost: learner ${self.cost_learner:.2f} + workers ${self.cost_workers:.2f} "
            f"= ${self.cost_total:.2f}  ({self.worker_hours:.1f} worker-hours)",
            f"kills {len(self.kills)}, lease returns {len(self.lease_returns)}, "
            f"re-solves {self.resolves} over {self.ticks} ticks",
            "",
            "decisions:",
        ]
        for d in self.decisions:
            jobs = ", ".join(
                f"{j} {d.active[j]} workers {d.throughput[j]:.2f}/{d.required[j]:.2f} r/s "
                f"${d.price_per_h[j]:.2f}/h" + ("" if d.feasible[j] else " INFEASIBLE")
                for j in d.active
            )
            out.append(f"  t={d.at:>7.0f}s {d.trigger} -> {d.method}: +{d.activated} -{d.deactivated}; {jobs}")
            out += [f"      {line}" for line in d.lines[:max_lines]]
            if len(d.lines) > max_lines:
                out.append(f"      ... {len(d.lines) - max_lines} more")
        return "\n".join(out)
