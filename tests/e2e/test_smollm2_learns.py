"""A real model improves on problems it never trained on, through the whole platform: `echo2-server
demo --model smollm2` (API, Celery scheduler, learner host, a CPU worker as real processes) trains
SmolLM2-135M-Instruct on two-digit addition, and the job's own held-out evaluation (100 problems of the
20 % never leased for training) is compared before and after. Slow: about STEPS x 25 s plus two
evaluations of a minute on a 2-core CPU. The long curve is bench/smollm2_learns.py's."""

import re
import subprocess
import sys

import pytest

from api.local import free_port
from tests.e2e.test_stack import stack_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 30


def test_smollm2_improves_its_held_out_accuracy_through_the_platform(tmp_path):
    done = subprocess.run([sys.executable, "-m", "api.cli", "demo", "--model", "smollm2", "--workers", "1",
                           "--steps", str(STEPS), "--port", str(free_port())], env=stack_env(tmp_path),
                          capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = next(line for line in done.stdout.splitlines() if line.startswith("succeeded: held-out accuracy"))
    greedy = re.search(r"held-out accuracy ([\d.]+) -> ([\d.]+) \(greedy, 100 problems never trained on", summary)
    sampled = re.search(r"sampled ([\d.]+) -> ([\d.]+)\)", summary)
    assert greedy and sampled, summary
    (greedy_before, greedy_after), (sampled_before, sampled_after) = (map(float, m.groups()) for m in (greedy, sampled))
    assert sampled_after >= sampled_before + 0.05, summary
    assert greedy_after >= greedy_before, summary
