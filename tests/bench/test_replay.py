"""bench/replay.py in its two stages, as scripts/gpu_check.sh runs them on a GPU and the CPU auditor at home:
groups drawn and written by one process, judged by another from the same versions."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _replay(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "bench/replay.py", "--no-vllm", *args], cwd=ROOT, timeout=timeout,
                          capture_output=True, text=True)


def test_groups_drawn_in_one_stage_are_judged_in_the_next(tmp_path: Path) -> None:
    versions, drawn, out = tmp_path / "versions", tmp_path / "drawn.json.gz", tmp_path / "figures.json"
    made = _replay("--stage", "generate", "--versions", str(versions), "--generated", str(drawn), "--honest", "24",
                   "--cheat", "8", "--dtype", "bfloat16")
    assert made.returncode == 0, made.stderr[-3000:]
    judged = _replay("--stage", "audit", "--versions", str(versions), "--generated", str(drawn), "--out", str(out))
    assert judged.returncode == 0, judged.stderr[-3000:]
    report = json.loads(out.read_text())
    honest = report["honest"]["transformers cpu bfloat16"]
    assert honest["groups"] == 24 and honest["rejected"] == 0  # bf16 workers, an fp32 auditor: no false alarm
    copy = report["cheats"]["copy (transformers cpu bfloat16)"]
    assert copy["groups"] == copy["caught"] == 8
    assert report["auditor"] == "cpu float32"


def test_a_cheat_claiming_bf16_with_noisy_logprobs_is_judged_with_and_without_the_shadow(tmp_path: Path) -> None:
    """`--disguise bfloat16`: the stale cheat's groups, drawn and rescored in float32, claim bfloat16 with noisy
    logprobs; without the auditor's shadow the margin widens to bf16's bound and nearly all pass, with it most of
    those unlike an honest draw are caught."""
    out = tmp_path / "figures.json"
    run = _replay("--honest", "8", "--cheat", "90", "--cheats", "stale", "--disguise", "bfloat16",
                  "--versions", str(tmp_path / "versions"), "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    cheats = json.loads(out.read_text())["cheats"]
    plain, without, capped = (cheats[f"stale{side} (transformers cpu float32)"] for side in
                              ("", " claiming bfloat16, no shadow", " claiming bfloat16, shadow"))
    assert plain["effective"] == without["effective"] == capped["effective"] > 20
    assert without["caught_effective"] <= 0.2 * without["effective"]
    assert capped["caught_effective"] >= 0.6 * capped["effective"]
    assert "stale claiming bfloat16, shadow" in run.stdout


def test_a_stage_without_what_it_needs_says_what_to_give(tmp_path: Path) -> None:
    missing = _replay("--stage", "generate")
    assert missing.returncode == 2 and "--generated FILE" in missing.stderr
    empty = _replay("--stage", "audit", "--generated", str(tmp_path / "x"), "--versions", str(tmp_path))
    assert empty.returncode == 2 and "--versions DIR holding the versions" in empty.stderr
    none = _replay("--backends", "vllm")  # _replay passes --no-vllm
    assert none.returncode == 2 and "no backend left to draw with" in none.stderr


@pytest.mark.slow
def test_smollm2_groups_are_replayed_and_its_cheats_judged(tmp_path: Path) -> None:
    """`--model smollm2`: SmolLM2's versions trained by real GRPO steps, its groups drawn by the worker's backend
    and judged by the replay (minutes: the GGUF is converted once, six versions trained)."""
    out = tmp_path / "figures.json"
    run = _replay("--model", "smollm2", "--honest", "6", "--cheat", "3", "--versions", str(tmp_path / "v"),
                  "--out", str(out), timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["model"], report["new_tokens"]) == ("smollm2", 16)
    honest = report["honest"]["transformers cpu float32"]
    assert honest["groups"] == 6 and honest["rejected"] == 0 and honest["tokens"] > 6 * 8
    for cheat in ("copy", "eos"):  # never an honest draw: always caught
        figures = report["cheats"][f"{cheat} (transformers cpu float32)"]
        assert figures["groups"] == figures["caught"] == 3
