"""`echo2-worker` as a person runs it: fast --help, join as a real process (saved 0600 credentials,
reuse after a crash, SIGTERM drain with no lease left), status, bench. Uses this venv's install."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from api.models import Lease
from tests.conftest import Api
from tests.factories import activate

from .conftest import rollouts, start_job, wait_for, worker_row

CLI = [sys.executable, "-m", "echo2_worker.cli"]


def test_help_is_fast_and_never_imports_torch() -> None:
    code = ("import sys, time; t = time.perf_counter(); from echo2_worker.cli import build_parser\n"
            "for cmd in ([], ['join'], ['bench'], ['status']):\n"
            "    try: build_parser().parse_args([*cmd, '--help'])\n"
            "    except SystemExit: pass\n"
            "print(time.perf_counter() - t, 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    seconds, torch, transformers = out.split()[-3:]
    assert (torch, transformers) == ("False", "False")
    assert float(seconds) < 1.0
    t0 = time.perf_counter()
    proc = subprocess.run([*CLI, "join", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--max-upload-mbps" in proc.stdout and "--no-relay" in proc.stdout
    assert time.perf_counter() - t0 < 1.5  # interpreter start included


def test_join_errors_are_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([*CLI, "--config-dir", str(tmp_path), "join", "--server", "http://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["echo2-worker: error: --token PROVIDER_TOKEN (or ECHO2_PROVIDER_TOKEN) "
                                                "is required the first time you join this server"]


def join(api: Api, token: str | None, tmp_path: Path, *extra: str, token_in_env: bool = False) -> subprocess.Popen:
    args = [*CLI, "--config-dir", str(tmp_path / "config"), "join", "--server", api.url, "--name", "cli-worker",
            "--data-dir", str(tmp_path / "data"), "--no-bench", "--json", "--max-prompts", "4", *extra]
    env = {k: v for k, v in os.environ.items() if k != "ECHO2_PROVIDER_TOKEN"}
    if token and token_in_env:
        env["ECHO2_PROVIDER_TOKEN"] = token
    elif token:
        args += ["--token", token]
    log = open(tmp_path / "worker.log", "a")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)


def registered(api: Api, name: str = "cli-worker") -> list[dict]:
    items = api.admin.get("/v1/workers", params={"limit": 500}).json()["items"]
    return [w for w in items if w["name"] == name and w["status"] != "deregistered"]


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.mark.parametrize("relay", [False, True], ids=["no-relay", "relay"])
def test_join_runs_survives_a_crash_and_drains_on_sigterm(api: Api, tiny_model_dir: Path, tmp_path: Path,
                                                          relay: bool) -> None:
    setup = start_job(api, tiny_model_dir)
    relay_args = ["--relay-port", "0", "--relay-host", "127.0.0.1"] if relay else ["--no-relay"]
    # The relay variant passes the provider token in the environment, which keeps it out of `ps`.
    proc = join(api, setup.provider_token, tmp_path, *relay_args, token_in_env=relay)
    try:
        assert relay == (setup.provider_token not in " ".join(map(str, proc.args)))
        worker = wait_for(lambda: registered(api), 60, "the worker to register")[0]
        assert (worker["relay_url"] is not None) == relay
        creds = tmp_path / "config" / "credentials.json"
        wait_for(creds.exists, 30, "the saved credentials")  # written once the registration reply is in
        assert stat.S_IMODE(creds.stat().st_mode) == 0o600
        activate(api, worker["id"], setup.id)
        wait_for(lambda: rollouts(api, setup.id, "accepted"), 120, "accepted rollouts")

        # A crash loses nothing, and a second join reuses the saved registration (no --token needed).
        stop(proc, signal.SIGKILL)
        proc = join(api, None, tmp_path, *relay_args) if not relay else None
        if proc is not None:
            n = len(rollouts(api, setup.id, "accepted"))
            wait_for(lambda: len(rollouts(api, setup.id, "accepted")) > n, 120, "rollouts after the restart")
            assert [w["id"] for w in registered(api)] == [worker["id"]]
        else:  # with an ephemeral relay port the identity changed: the old worker is replaced
            proc = join(api, None, tmp_path, *relay_args)
            new = wait_for(lambda: [w for w in registered(api) if w["id"] != worker["id"]], 60, "re-registration")
            assert worker_row(api, worker["id"])["status"] == "deregistered"
            activate(api, new[0]["id"], setup.id)
            worker = new[0]
            n = len(rollouts(api, setup.id, "accepted"))
            wait_for(lambda: len(rollouts(api, setup.id, "accepted")) > n, 120, "rollouts after the restart")

        status = subprocess.run([*CLI, "--config-dir", str(tmp_path / "config"), "status", "--json"],
                                capture_output=True, text=True, timeout=60, check=True)
        shown = json.loads(status.stdout)[0]
        assert shown["worker_id"] == worker["id"] and shown["server_says"]["status"] in ("active", "idle")
        assert setup.provider_token not in status.stdout and "e2w_" not in status.stdout

        assert stop(proc) == 0
        proc = None
        with api.db.session() as s:
            left = s.scalars(select(Lease).where(Lease.worker_id == worker["id"], Lease.status == "active")).all()
        assert left == []
        assert worker_row(api, worker["id"])["status"] == "deregistered"
        saved = json.loads(creds.read_text())["servers"][api.url]
        assert saved["worker_id"] is None and saved["provider_token"] == setup.provider_token
        logs = (tmp_path / "worker.log").read_text()
        assert setup.provider_token not in logs and "e2w_" not in logs
        assert all(json.loads(line)["level"] for line in logs.splitlines() if line.startswith("{"))
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()


def test_bench_reports_throughput(tmp_path: Path, tiny_model_dir: Path) -> None:
    proc = subprocess.run([*CLI, "--config-dir", str(tmp_path), "bench", "--backend", "transformers", "--seconds",
                           "1", "--max-new-tokens", "8", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["tokens_per_s"] > 0 and result["groups_per_s"] > 0
    # beside model.generate on the same device and rows: the ratio is what it says
    assert result["vs_generate"] == pytest.approx(result["tokens_per_s"] / result["generate_tokens_per_s"], rel=0.01)
    assert json.loads((tmp_path / "bench.json").read_text())["tokens_per_s"] == result["tokens_per_s"]


def test_join_takes_the_gpu_settings_a_provider_needs() -> None:
    """--dtype, --gpu-memory, --max-batch and --compile-decode reach the backend (vLLM's engine or the
    transformers batch), and a share of memory or a batch out of range is refused before anything starts."""
    from echo2_worker.cli import _backend_factory, build_parser

    parser = build_parser()
    args = parser.parse_args(["join", "--server", "http://x", "--dtype", "bfloat16", "--gpu-memory", "0.6",
                              "--max-batch", "256", "--compile-decode"])
    vllm = _backend_factory("vllm", args)()
    assert vllm.engine_kwargs | {"dtype": "bfloat16", "gpu_memory_utilization": 0.6, "max_num_seqs": 256} == \
        vllm.engine_kwargs
    hf = _backend_factory("transformers", args)()
    assert (hf._dtype_arg, hf.memory_share, hf.max_batch_rows, hf.compile_decode) == ("bfloat16", 0.6, 256, True)
    for bad in (["--gpu-memory", "1.5"], ["--max-batch", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["join", "--server", "http://x", *bad])
