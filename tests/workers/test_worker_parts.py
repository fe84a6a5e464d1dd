"""Small pure parts of the worker: --gpus parsing, secret scrubbing, private credential files."""

from __future__ import annotations

import json
import logging
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from echo2_worker.config import CredentialStore, SavedWorker, normalize_server
from echo2_worker.hardware import Gpus, parse_gpus
from echo2_worker.progress import JsonFormatter, Stats, scrub


@pytest.fixture
def nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str | None], None]:
    """This machine as nvidia-smi describes it: its CSV rows (name, MiB), or None for a machine without it."""
    def machine(rows: str | None) -> None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        if rows is not None:
            smi = bin_dir / "nvidia-smi"
            smi.write_text(f"#!/bin/sh\nprintf '{rows}'\n")
            smi.chmod(0o755)
        monkeypatch.setenv("PATH", str(bin_dir))

    return machine


H100S = "NVIDIA H100 80GB HBM3, 81559\\nNVIDIA H100 80GB HBM3, 81559\\n"  # two of them: 79.6 GiB each


@pytest.mark.parametrize(("spec", "gpus"), [
    ("none", Gpus()), ("cpu", Gpus()), ("cpu:0:16", Gpus("cpu", 0, 16.0)), ("H100:8:80", Gpus("H100", 8, 80.0)),
])
def test_parse_gpus(spec: str, gpus: Gpus, nvidia_smi: Callable[[str | None], None]) -> None:
    nvidia_smi(None)
    assert parse_gpus(spec) == gpus


@pytest.mark.parametrize(("spec", "gpus"), [
    ("auto", Gpus("H100 80GB HBM3", 2, 79.6)), ("8", Gpus("H100 80GB HBM3", 8, 79.6)),
    ("H100:8", Gpus("H100", 8, 79.6)), ("H100x2", Gpus("H100", 2, 79.6)), ("H100", Gpus("H100", 1, 79.6)),
])
def test_vram_left_out_comes_from_nvidia_smi(spec: str, gpus: Gpus, nvidia_smi: Callable[[str | None], None]) -> None:
    nvidia_smi(H100S)
    assert parse_gpus(spec) == gpus


@pytest.mark.parametrize("smi", [None, "NVIDIA H100, [N/A]\\n"], ids=["no-nvidia-smi", "no-memory-reported"])
@pytest.mark.parametrize(("spec", "example"), [
    ("H100:8", "H100:8:80"), ("bogus", "bogus:1:80"), ("4", ":4:80"), ("RTX 4090x2", "RTX 4090:2:80"),
])
def test_a_gpu_whose_vram_is_unknown_is_refused(spec: str, example: str, smi: str | None,
                                                nvidia_smi: Callable[[str | None], None]) -> None:
    """Registered with 0 GiB, the worker would idle forever: the scheduler gives it no job that needs memory."""
    nvidia_smi(smi)
    with pytest.raises(ValueError, match="nvidia-smi reports no GPU memory") as refused:
        parse_gpus(spec)
    assert f"{example} (or --gpus none for a CPU worker)" in str(refused.value)


@pytest.mark.parametrize("spec", ["H100:lots", "H100:8:much", "H100:65:80", "H100:-1:80", "H100:8:-80", "H100:8:nan"])
def test_bad_gpus_spec_says_what_is_expected(spec: str) -> None:
    with pytest.raises(ValueError, match=r"MODEL:COUNT|0 to 64 GPUs of 0 to 4096 GiB each, e\.g\. H100:8:80"):
        parse_gpus(spec)


def test_tokens_never_reach_a_log_line() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "joined with %s and header %s", (
        "e2p_abcdefghijkl0123", "Bearer e2w_secret-token"), None)
    line = JsonFormatter().format(record)
    assert "e2p_" not in line and "e2w_" not in line and json.loads(line)["msg"].count("[redacted]") == 2
    assert scrub("no secret here") == "no secret here"


def test_tracebacks_are_scrubbed_too() -> None:
    try:
        raise RuntimeError("401 for Bearer e2w_secret-token")
    except RuntimeError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = json.loads(JsonFormatter().format(record))
    assert "RuntimeError" in line["exc"] and "e2w_" not in line["exc"] and line["level"] == "error"


def test_join_logs_json_when_the_environment_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    from echo2_worker.cli import build_parser

    join = ["join", "--server", "http://127.0.0.1:9"]
    monkeypatch.delenv("ECHO2_LOG_FORMAT", raising=False)
    assert build_parser().parse_args(join).json is False
    monkeypatch.setenv("ECHO2_LOG_FORMAT", "json")
    assert build_parser().parse_args(join).json is True


def test_credentials_are_private_and_per_server(tmp_path: Path) -> None:
    store = CredentialStore(tmp_path / "cfg")
    store.save(SavedWorker(server=normalize_server("http://a.example/"), provider_token="e2p_x", worker_id="w1",
                           worker_token="e2w_y"))
    store.save(SavedWorker(server="http://b.example", provider_token="e2p_z"))
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert store.load("http://a.example").worker_id == "w1"
    store.forget_worker("http://a.example", "w0")  # another worker's: this one stays
    assert store.load("http://a.example").worker_id == "w1"
    store.forget_worker("http://a.example", "w1")
    again = store.load("http://a.example")
    assert again.worker_id is None and again.worker_token is None and again.provider_token == "e2p_x"
    assert "e2p_" not in json.dumps(again.public())
    with pytest.raises(ValueError, match="http"):
        normalize_server("a.example")


def test_a_second_worker_saved_for_a_server_keeps_the_first_beside_it(tmp_path: Path) -> None:
    store = CredentialStore(tmp_path / "cfg")
    store.save(SavedWorker(server="http://a.example", provider_token="e2p_x", worker_id="w1", worker_token="e2w_1"))
    store.save(SavedWorker(server="http://a.example", provider_token="e2p_x", worker_id="w2", worker_token="e2w_2"))
    assert [w.worker_id for w in store.saved("http://a.example")] == ["w2", "w1"]
    assert store.load("http://a.example").worker_id == "w2"
    store.save(SavedWorker(server="http://a.example", provider_token="e2p_x", worker_id="w1", worker_token="e2w_1"))
    assert [w.worker_id for w in store.saved("http://a.example")] == ["w1", "w2"]  # saved again: the last, once
    store.forget_worker("http://a.example", "w2")
    assert [w.worker_id for w in store.all()] == ["w1"]


@pytest.mark.parametrize("url", ["http://a.example/v1", "http://a.example/v1/"])
def test_a_server_url_ending_in_v1_is_refused(url: str) -> None:
    """The worker adds /v1/... itself: with a second /v1 it found no route, and said so only after its benchmark."""
    with pytest.raises(ValueError) as refused:
        normalize_server(url)
    assert str(refused.value) == (f"--server {url.rstrip('/')!r} ends in /v1: give the control plane's base URL "
                                  "without it, --server http://a.example")


def test_progress_line_shows_version_leases_rates() -> None:
    stats = Stats()
    stats.version_loaded, stats.version_held, stats.leases_done = 3, 4, 7
    stats.tokens.add(1000)
    line = stats.line()
    assert "v3 (v4 on disk)" in line and "leases 7" in line and "tok/s" in line and "MB/s" in line
