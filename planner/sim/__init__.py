"""Discrete-event simulator of an Echo2 deployment, driving the real capacity rule and solver.

from planner.sim import load_scenario, simulate
result = simulate(load_scenario("planner/sim/scenarios/hetero_1000.toml"))
print(result.table())
"""

from planner.sim.engine import Simulation, simulate
from planner.sim.report import DecisionSummary, JobResult, LeaseReturn, SimResult
from planner.sim.scenario import (
    EventSpec,
    JobSpec,
    RelaySpec,
    Scenario,
    ScenarioError,
    WorkerSpec,
    WorkerType,
    expand_workers,
    load_scenario,
    scenario_from_dict,
)
from planner.sim.state import InvariantError

__all__ = [
    "DecisionSummary",
    "EventSpec",
    "InvariantError",
    "JobResult",
    "JobSpec",
    "LeaseReturn",
    "RelaySpec",
    "Scenario",
    "ScenarioError",
    "SimResult",
    "Simulation",
    "WorkerSpec",
    "WorkerType",
    "expand_workers",
    "load_scenario",
    "scenario_from_dict",
    "simulate",
]
