"""bench/spare_audits.py runs the demo job with spare audits off and on, a trusted cheater in the fleet, and prints a
line for each side."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_bench_runs_both_sides_and_prints_what_each_audited() -> None:
    proc = subprocess.run([sys.executable, "bench/spare_audits.py", "--rounds", "1", "--max-steps", "3"],
                          cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["off"], ["on"])}
    assert set(rows) == {"off", "on"}, proc.stdout
    for side, cells in rows.items():
        assert cells[1] == "3", (side, cells)  # the job's steps, all trained
        audited, groups = int(cells[8]), int(cells[10])
        assert 0 < audited <= groups, (side, cells)
