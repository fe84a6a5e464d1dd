"""The control-plane load benchmark runs end to end (tiny and short: figures come from the real run)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_load_benchmark_runs_every_phase_on_sqlite(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    # 4 s a phase: on a loaded 2-core machine one rollouts request (4 groups) has taken over 1 s. Audits: 1 group
    # a claim, 1,500 queued: far more than the claims take in 4.5 s (about 80 a second here).
    subprocess.run([sys.executable, "bench/load_api.py", "--db", "sqlite", "--duration", "4", "--warmup", "0.5",
                    "--workers", "12", "--concurrency", "4", "--heartbeat-rate", "40", "--prompts", "5000",
                    "--lease-prompts", "4", "--groups-per-request", "4", "--claim-groups", "1", "--audit-queue", "1500",
                    "--json", str(out)],
                   cwd=ROOT, check=True, timeout=600, capture_output=True)
    results = {r["phase"]: r for r in json.loads(out.read_text())}
    assert list(results) == ["heartbeat", "paced", "lease", "rollouts", "audits", "episodes", "tinker"]
    for phase, result in results.items():
        assert result["errors"] == {}, phase  # audits: no claim found the queue empty either
        # heartbeats, leases, accepted groups, verdicts recorded, episode steps answered, Tinker requests answered
        assert result["ops_per_s"] > 0, phase
        for row in result["rows"]:
            assert set(row["statuses"]) <= {"200", "201"}, (phase, row)
    assert results["paced"]["offered_per_s"] == 40
    for phase in ("rollouts", "audits", "episodes", "tinker"):  # groups accepted (audits: claimed), none refused
        assert results[phase]["groups_per_s"] > 0 and results[phase]["rejected_groups"] == 0, phase
    endpoints = {phase: {row["endpoint"] for row in result["rows"]} for phase, result in results.items()}
    assert endpoints["audits"] == {"claim", "audits"}
    assert endpoints["episodes"] == {"lease", "episodes", "rollouts"}
    assert endpoints["tinker"] == {"asample", "lease", "rollouts"}


def test_load_benchmark_ingests_partial_rollouts_without_a_heartbeat_phase(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    subprocess.run([sys.executable, "bench/load_api.py", "--db", "sqlite", "--phases", "rollouts", "--partial",
                    "--duration", "1", "--warmup", "0.5", "--workers", "8", "--concurrency", "4", "--prompts", "2000",
                    "--lease-prompts", "4", "--groups-per-request", "4", "--json", str(out)],
                   cwd=ROOT, check=True, timeout=300, capture_output=True)
    (result,) = json.loads(out.read_text())
    assert result["errors"] == {} and result["groups_per_s"] > 0 and result["rejected_groups"] == 0
    assert all(set(row["statuses"]) <= {"200", "201"} for row in result["rows"])
