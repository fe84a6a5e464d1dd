"""Small pure parts of the worker: --gpus parsing, secret scrubbing, private credential files."""

from __future__ import annotations

import json
import logging
import stat
import sys
from pathlib import Path

import pytest
from echo2_worker.config import CredentialStore, SavedWorker, normalize_server
from echo2_worker.hardware import Gpus, parse_gpus
from echo2_worker.progress import JsonFormatter, Stats, scrub


@pytest.mark.parametrize(("spec", "gpus"), [
    ("none", Gpus()), ("cpu", Gpus()), ("H100:8:80", Gpus("H100", 8, 80.0)), ("RTX 4090x2", Gpus("RTX 4090", 2)),
    ("A100", Gpus("A100", 1)),
])
def test_parse_gpus(spec: str, gpus: Gpus) -> None:
    assert parse_gpus(spec) == gpus


def test_bad_gpus_spec_says_what_is_expected() -> None:
    with pytest.raises(ValueError, match="MODEL:COUNT"):
        parse_gpus("H100:lots")


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
    store.forget_worker("http://a.example")
    again = store.load("http://a.example")
    assert again.worker_id is None and again.worker_token is None and again.provider_token == "e2p_x"
    assert "e2p_" not in json.dumps(again.public())
    with pytest.raises(ValueError, match="http"):
        normalize_server("a.example")


def test_progress_line_shows_version_leases_rates() -> None:
    stats = Stats()
    stats.version_loaded, stats.version_held, stats.leases_done = 3, 4, 7
    stats.tokens.add(1000)
    line = stats.line()
    assert "v3 (v4 on disk)" in line and "leases 7" in line and "tok/s" in line and "MB/s" in line
