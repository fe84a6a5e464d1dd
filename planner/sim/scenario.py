"""Simulator scenarios: plain dataclasses, loaded from TOML (planner/sim/scenarios/*.toml).

Units in TOML: seconds, $/h, GiB for VRAM, GB (10^9 bytes) for model size, MB (10^6 bytes) for
chunks, Mbit/s for bandwidth. A worker type expands into `count` workers whose bandwidths are
drawn log-uniformly from their ranges and whose price and generation time vary by ± the jitter.
"""

from __future__ import annotations

import math
import random
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from echo2 import protocol
from pydantic import ValidationError

from planner.capacity import JobProfile, validate_job
from planner.decision import SolverConfig


class ScenarioError(ValueError):
    """A scenario file that cannot be simulated; the message names the field."""


@dataclass(frozen=True, slots=True)
class JobSpec:
    job_id: str
    rollouts_per_step: int  # R, prompt groups per learner step
    t_train_s: float
    staleness: int  # S
    max_steps: int
    publish_period: int = 1  # κ
    headroom: float = 0.1  # h; negative under-provisions on purpose
    model_gb: float = 8.0  # a whole version, in GB: what a newly activated worker fetches
    # What a worker holding the previous version fetches per version (a delta, or a LoRA adapter), in GB;
    # None: whole versions every time.
    version_gb: float | None = None
    vram_need_gb: float = 0.0
    backends: tuple[str, ...] = ()
    priority: int = 0
    submit_at_s: float = 0.0
    learner_price_per_h: float = 0.0  # the reserved learner cluster
    gen_scale: float = 1.0  # this job's T_gen relative to the worker type's reference T_gen
    t_train_jitter: float = 0.0  # relative spread of a step's duration (uniform ±)

    @property
    def version_bytes(self) -> float:
        return (self.version_gb if self.version_gb is not None else self.model_gb) * 1e9

    def profile(self, t_train_s: float | None = None) -> JobProfile:
        return JobProfile(
            job_id=self.job_id,
            rollouts_per_step=self.rollouts_per_step,
            t_train_s=self.t_train_s if t_train_s is None else t_train_s,
            staleness=self.staleness,
            publish_period=self.publish_period,
            headroom=self.headroom,
            vram_need_gb=self.vram_need_gb,
            backends=frozenset(self.backends),
            priority=self.priority,
            submitted_at=self.submit_at_s,
        )

    def platform_spec(self) -> protocol.JobSpec:
        """The platform's own spec of this job, whose methods state the staleness rule the simulator
        obeys (`admissible`, `oldest_admissible`); what the simulator does not model keeps its default."""
        return protocol.JobSpec(
            name=self.job_id,
            base_model="simulated",
            task=protocol.TaskSpec(name="simulated"),
            staleness=self.staleness,
            publish_period=self.publish_period,
        )


@dataclass(frozen=True, slots=True)
class WorkerType:
    name: str
    count: int
    price_per_h: float
    vram_gb: float
    backend: str
    concurrency: int  # groups generated at once
    t_gen_s: float  # seconds per group (reference model); μ = concurrency / t_gen_s
    down_mbps: tuple[float, float]
    up_mbps: tuple[float, float]
    price_jitter: float = 0.0
    t_gen_jitter: float = 0.0  # per-worker spread of T_gen (uniform ±)
    preempt_mean_s: float = 0.0  # mean time between preemptions; 0: never preempted
    rejoin_after_s: float = 0.0  # a preempted worker comes back after this; 0: never


@dataclass(frozen=True, slots=True)
class RelaySpec:
    topology: str = "tree"  # "tree" | "chain" | "star"
    fanout: int = 2
    origin_fanout: int = 4  # children of the origin (the learner side has the fat uplink)
    chunk_mb: float = 16.0
    origin_up_mbps: float = 10_000.0
    hop_latency_s: float = 0.05


@dataclass(frozen=True, slots=True)
class EventSpec:
    at_s: float
    kind: str  # "kill_active" | "price"
    fraction: float = 0.0  # kill_active: share of the active, alive workers to kill
    job_id: str = ""  # kill_active: only that job's workers; empty: all jobs
    rejoin_after_s: float = 0.0  # kill_active: killed workers come back after this; 0: never
    worker_type: str = ""  # price: which type
    price_factor: float = 1.0  # price: multiply that type's price


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    jobs: tuple[JobSpec, ...]
    worker_types: tuple[WorkerType, ...]
    seed: int = 0
    tick_s: float = 10.0  # reconcile period, also the heartbeat interval
    lease_ttl_s: float = 60.0
    dead_after_s: float = 30.0  # a worker silent for this long is reported not alive
    max_sim_s: float = 10 * 86400.0
    measure_noise: float = 0.0  # spread of the scheduler's measurement errors on μ and T_bcast
    # The live loop's own latencies (defaults: what the live system does):
    notice_s: float = 0.0  # publication to a worker hearing of it (long-poll: ~0; heartbeat only: ~tick_s / 2)
    learner_poll_s: float = 0.0  # a learner waiting for groups sees them after this (0: the live long-poll claim)
    step_overhead_s: float = 0.0  # wall time per step outside training: claim, report, hand-off to publishing
    relay: RelaySpec = field(default_factory=RelaySpec)
    solver: SolverConfig = field(default_factory=SolverConfig)
    events: tuple[EventSpec, ...] = ()

    def with_fleet_scaled(self, factor: int) -> Scenario:
        """The same scenario with `factor` times as many workers of every type."""
        types = tuple(replace(t, count=t.count * factor) for t in self.worker_types)
        return replace(self, worker_types=types)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One concrete worker, drawn from its type."""

    worker_id: str
    type_name: str
    price_per_h: float
    vram_gb: float
    backend: str
    concurrency: int
    t_gen_s: float
    down_Bps: float
    up_Bps: float
    preempt_mean_s: float
    rejoin_after_s: float


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    if lo == hi:
        return lo
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def expand_workers(scenario: Scenario) -> list[WorkerSpec]:
    """Deterministic (seeded) concrete workers for the scenario's types."""
    rng = random.Random(scenario.seed)
    out = []
    for wt in scenario.worker_types:
        for k in range(wt.count):
            out.append(
                WorkerSpec(
                    worker_id=f"{wt.name}-{k:04d}",
                    type_name=wt.name,
                    price_per_h=round(wt.price_per_h * (1 + rng.uniform(-1, 1) * wt.price_jitter), 4),
                    vram_gb=wt.vram_gb,
                    backend=wt.backend,
                    concurrency=wt.concurrency,
                    t_gen_s=wt.t_gen_s * (1 + rng.uniform(-1, 1) * wt.t_gen_jitter),
                    down_Bps=_log_uniform(rng, *wt.down_mbps) * 1e6 / 8,
                    up_Bps=_log_uniform(rng, *wt.up_mbps) * 1e6 / 8,
                    preempt_mean_s=wt.preempt_mean_s,
                    rejoin_after_s=wt.rejoin_after_s,
                )
            )
    return out


# ---------------------------------------------------------------- TOML


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ScenarioError(f"{where}: unknown field(s) {', '.join(unknown)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ScenarioError(f"{where}: {exc}") from exc


def _pair(value: Any, where: str) -> tuple[float, float]:
    if isinstance(value, int | float):
        return (float(value), float(value))
    if isinstance(value, list) and len(value) == 2 and 0 < value[0] <= value[1]:
        return (float(value[0]), float(value[1]))
    raise ScenarioError(f"{where}: expected a number or [low, high] with 0 < low ≤ high, got {value!r}")


def scenario_from_dict(data: dict[str, Any]) -> Scenario:
    data = dict(data)
    jobs = []
    for i, raw in enumerate(data.pop("jobs", [])):
        raw = dict(raw)
        raw["job_id"] = str(raw.pop("id", raw.get("job_id", f"job{i}")))
        raw["backends"] = tuple(raw.get("backends", ()))
        jobs.append(_build(JobSpec, raw, f"jobs[{i}]"))
    types = []
    for i, raw in enumerate(data.pop("worker_types", [])):
        raw = dict(raw)
        raw["down_mbps"] = _pair(raw.get("down_mbps"), f"worker_types[{i}].down_mbps")
        raw["up_mbps"] = _pair(raw.get("up_mbps"), f"worker_types[{i}].up_mbps")
        types.append(_build(WorkerType, raw, f"worker_types[{i}]"))
    relay = _build(RelaySpec, data.pop("relay", {}), "relay")
    try:
        solver = _build(SolverConfig, data.pop("solver", {}), "solver")
    except ValueError as exc:
        raise ScenarioError(f"solver: {exc}") from exc
    events = tuple(_build(EventSpec, dict(e), f"events[{i}]") for i, e in enumerate(data.pop("events", [])))
    scenario = _build(
        Scenario,
        {
            **data,
            "jobs": tuple(jobs),
            "worker_types": tuple(types),
            "relay": relay,
            "solver": solver,
            "events": events,
        },
        "scenario",
    )
    check(scenario)
    return scenario


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: {exc}") from exc
    data.setdefault("name", path.stem)
    return scenario_from_dict(data)


def check(scenario: Scenario) -> None:
    """Raise ScenarioError on the first field that makes the scenario meaningless."""
    if not scenario.jobs:
        raise ScenarioError("scenario: at least one [[jobs]] table is needed")
    ids = [j.job_id for j in scenario.jobs]
    if len(set(ids)) != len(ids):
        raise ScenarioError("jobs: job ids must be unique")
    for job in scenario.jobs:
        # a negative headroom under-provisions on purpose, down to (but not) nothing at all
        problems = validate_job(replace(job.profile(), headroom=max(job.headroom, 0.0)))
        if job.headroom <= -1:
            problems.append("headroom must be > -1")
        if job.max_steps < 1:
            problems.append("max_steps must be ≥ 1")
        if problems:
            raise ScenarioError(f"jobs[{job.job_id}]: {'; '.join(problems)}")
        try:
            job.platform_spec()
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ScenarioError(f"jobs[{job.job_id}]: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    for wt in scenario.worker_types:
        if wt.count < 0 or wt.concurrency < 1 or wt.t_gen_s <= 0 or wt.price_per_h < 0:
            raise ScenarioError(f"worker_types[{wt.name}]: count ≥ 0, concurrency ≥ 1, t_gen_s > 0, price ≥ 0")
    if scenario.relay.topology not in ("tree", "chain", "star"):
        raise ScenarioError(f"relay.topology must be tree, chain or star, got {scenario.relay.topology!r}")
    if scenario.relay.fanout < 1 or scenario.relay.origin_fanout < 1:
        raise ScenarioError("relay.fanout and relay.origin_fanout must be ≥ 1")
    if scenario.tick_s <= 0 or scenario.lease_ttl_s <= 0:
        raise ScenarioError("tick_s and lease_ttl_s must be > 0")
    if scenario.notice_s < 0 or scenario.learner_poll_s < 0 or scenario.step_overhead_s < 0:
        raise ScenarioError("notice_s, learner_poll_s and step_overhead_s must be ≥ 0")
    for ev in scenario.events:
        if ev.kind not in ("kill_active", "price"):
            raise ScenarioError(f"events: kind must be kill_active or price, got {ev.kind!r}")
