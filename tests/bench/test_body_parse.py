"""bench/body_parse.py reads one body both ways: both give the same submission, and it prints both and their ratio."""

import subprocess
import sys
from pathlib import Path

from echo2.protocol import RolloutSubmit

from bench.body_parse import submission

ROOT = Path(__file__).resolve().parents[2]


def test_the_body_is_a_submission_the_api_accepts_as_a_worker_sends_it() -> None:
    body = RolloutSubmit.model_validate_json(submission(groups=3, group_size=4, tokens=5, vocab=100))
    assert [len(g.samples) for g in body.groups] == [4, 4, 4]
    assert all(len(s.token_ids) == len(s.logprobs) == 5 and max(s.token_ids) < 100
               for g in body.groups for s in g.samples)


def test_the_bench_prints_both_ways_and_their_ratio() -> None:
    proc = subprocess.run([sys.executable, "bench/body_parse.py", "--groups", "2", "--calls", "2", "--rounds", "1"],
                          cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any("(FastAPI)" in line for line in lines) and any("(ModelBody)" in line for line in lines)
    assert any(line.strip().startswith("ratio (ModelBody / FastAPI)") for line in lines)
