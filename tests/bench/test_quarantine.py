"""bench/quarantine.py runs the trust rules themselves (api/services/trust.py): the cases where the rules
promise a number hold in its trials, and the bench prints its table."""

import subprocess
import sys
from pathlib import Path

from bench.quarantine import run

ROOT = Path(__file__).resolve().parents[2]


def test_the_trust_rules_bound_what_an_always_caught_cheat_sends() -> None:
    rows = {(r["cheat"], r["start"]): r for r in run({"copy": 1.0, "eos": 1.0, "none": 0.0}, trials=40, cap=300,
                                                     seed=1)}
    for start in ("from its first group", "after trust"):
        # flagged at the door, so audited whatever the trust: caught at its first group, quarantined at its second
        assert rows["copy", start]["median"] == rows["copy", start]["p99"] == 2
        assert rows["none", start]["not_by_cap"] == 40  # a group never caught never quarantines
    assert rows["eos", "from its first group"]["p99"] == 2  # on probation every group is audited
    # a trusted worker's windows of 10 audit one of its next 19 groups; a suspect's next group then
    assert rows["eos", "after trust"]["within_20"] == 1.0


def test_the_bench_prints_its_table() -> None:
    proc = subprocess.run([sys.executable, "bench/quarantine.py", "--trials", "5", "--cap", "200"], cwd=ROOT,
                          timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum(line.startswith("| stale |") for line in proc.stdout.splitlines()) == 2
