"""`echo2-server simulate SCENARIO.toml [--json] [--scale N]`: run the scheduler simulator on a scenario."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def _native_stdout_to_stderr() -> Iterator[None]:
    """HiGHS (scipy's MILP solver) now and then prints a stray debug line straight to file descriptor 1
    (ERGO-Code/HiGHS#2783); while the simulation runs, fd 1 is stderr, so stdout holds only the result
    and `--json` stays parseable."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def simulate_main(argv: list[str]) -> int:
    """Entry point for `echo2-server simulate`; argv excludes the subcommand name."""
    parser = argparse.ArgumentParser(
        prog="echo2-server simulate",
        description="Simulate a deployment (learner, heterogeneous workers, relay, churn) driven by the real "
        "capacity rule and activation solver, and print utilisation, cost and activation decisions.",
    )
    parser.add_argument("scenario", help="scenario TOML file (see planner/sim/scenarios/)")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("--method", choices=("milp", "greedy", "all"), help="override the scenario's solver method")
    parser.add_argument("--lines", type=int, default=8, help="explanation lines shown per decision (default 8)")
    parser.add_argument("--scale", type=int, default=1, metavar="N",
                        help="N times as many workers of every type as the scenario has (default 1)")
    args = parser.parse_args(argv)
    if args.scale < 1:
        parser.error("--scale must be at least 1")

    import dataclasses  # after parsing, so --help stays instant

    from planner.sim import ScenarioError, load_scenario, simulate

    try:
        scenario = load_scenario(args.scenario)
    except FileNotFoundError:
        print(f"error: scenario file not found: {args.scenario}", file=sys.stderr)
        return 2
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.method:
        scenario = dataclasses.replace(scenario, solver=dataclasses.replace(scenario.solver, method=args.method))
    scenario = scenario.with_fleet_scaled(args.scale)
    with _native_stdout_to_stderr():
        result = simulate(scenario)
    if args.json:
        print(json.dumps(result.to_dict(max_lines=args.lines), indent=2))
    else:
        print(result.table(max_lines=args.lines))
    return 0 if all(j.completed for j in result.jobs) and result.prompts_lost == 0 else 1
