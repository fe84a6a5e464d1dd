"""bench/gpu.py --smoke runs every stage of the GPU benchmark on the CPU (the tiny shape: the code paths, not
the figures) and ends with its summary line."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_benchmark_runs_every_stage_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--smoke", "--out", str(out)], cwd=ROOT, timeout=600,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"gpu: worker/bound n/a %, worker/generate [\d.]+, audit share [\d.]+ %, publish [\d.]+ "
                        r"steps, MFU n/a % \(cpu, smoke\)", last), last
    row = json.loads(out.read_text())["shapes"]["smoke"]
    assert row["stepped"] and row["audits_passed"] == row["audits"] > 0  # the worker's groups replay
    assert row["publish_bytes"] > 0 and row["worker_tokens_per_s"] > 0 and row["generate_tokens_per_s"] > 0
    assert row["errors"] == {}
    # the other KV cache and the compiled step draw the default's very tokens in float32
    assert {k: v["same_tokens"] for k, v in row["variants"].items()} == {"static": 1.0, "compiled": 1.0}


def test_quick_measures_only_the_workers_draw_and_judges_every_group_it_drew(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--smoke", "--quick", "--out", str(out)], cwd=ROOT,
                          timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(out.read_text())["shapes"]["smoke"]
    assert "step_s" not in row and row["variants"] == {} and row["generate_tokens_per_s"] is None
    groups = row["worker_rows"] // 8  # groups of G = 8, each sample 16 new tokens (the smoke shape)
    assert row["audits"] == row["audits_passed"] == groups and row["replayed"] == row["worker_rows"] * 16
    assert row["audit_share"] is None and row["errors"] == {}
