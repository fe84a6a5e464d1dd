"""`echo2-worker` as a person runs it: fast --help, join as a real process (saved 0600 credentials,
reuse after a crash, SIGTERM drain with no lease left), status, bench. Uses this venv's install."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from functools import partial
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from echo2_worker.cli import check_version
from echo2_worker.config import CredentialStore, SavedWorker
from echo2_worker.control import ControlPlane
from sqlalchemy import select

from api.models import Lease
from tests.conftest import Api
from tests.factories import activate, new_user, new_worker, ok

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
        assert shown["placement"] == []  # placed by hand here, not by a scheduler's decision
        plain = subprocess.run([*CLI, "--config-dir", str(tmp_path / "config"), "status"], capture_output=True,
                               text=True, timeout=60, check=True)
        assert f"worker {worker['id']}" in plain.stdout and "version held" in plain.stdout
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


@pytest.mark.parametrize("bad", ["-1", "abc", "nan", "20000"])
def test_a_bad_price_names_the_flag(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused by the parser, not by the registration's pydantic model (a raw validation error)."""
    from echo2_worker.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["join", "--server", "http://x", "--price-per-hour", bad])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("echo2-worker join: error: argument --price-per-hour: ") and "dollars per hour" in error


def provider_token(api: Api) -> str:
    return ok(api.admin.post("/v1/providers", json={"name": "gpu-co"}), 201)["token"]


@pytest.mark.parametrize("price", [None, "0.4"], ids=["forgotten", "given"])
def test_join_says_its_price_and_warns_when_it_works_for_free(api: Api, tmp_path: Path, price: str | None) -> None:
    proc = join(api, provider_token(api), tmp_path, "--no-relay", *(["--price-per-hour", price] if price else []))
    try:
        log = tmp_path / "worker.log"
        wait_for(lambda: "joined" in log.read_text(), 60, "the worker to join")
    finally:
        proc.kill()  # its drain is another test's: the signal may come before its handler is in place
        proc.wait(30)
    msgs = [json.loads(line)["msg"] for line in log.read_text().splitlines() if line.startswith("{")]
    joined = next(m for m in msgs if " joined " in m)
    assert joined.endswith(f"asking ${float(price or 0):.2f}/h (leaf only, no relay)")
    free = [m for m in msgs if "will earn nothing" in m]
    assert free == ([] if price else ["asking $0.00/h: this worker will earn nothing for its work; to be paid, join "
                                      "with --price-per-hour USD, e.g. --price-per-hour 0.40"])


def join_once(server: str, config: Path, *extra: str) -> subprocess.CompletedProcess:
    """A join expected to stop at once: with the benchmark on, so that one run first would show."""
    env = {k: v for k, v in os.environ.items() if k != "ECHO2_PROVIDER_TOKEN"}
    return subprocess.run([*CLI, "--config-dir", str(config), "join", "--server", server, "--name", "cli-worker",
                           "--no-relay", "--gpus", "none", "--data-dir", str(config / "data"), *extra],
                          capture_output=True, text=True, timeout=120, env=env)


def revoked_provider_token(api: Api) -> str:
    token = provider_token(api)
    row, = ok(api.admin.get("/v1/tokens", params={"kind": "provider"}))
    assert api.admin.delete(f"/v1/tokens/{row['id']}").status_code == 204
    return token


@pytest.mark.parametrize("kind", ["unknown", "revoked", "saved-revoked", "user", "worker"])
def test_a_wrong_token_is_refused_before_the_benchmark(api: Api, tmp_path: Path, kind: str) -> None:
    config = tmp_path / "config"
    if kind == "saved-revoked":  # a provider token saved by an earlier join, revoked since
        CredentialStore(config).save(SavedWorker(server=api.url, provider_token=revoked_provider_token(api)))
    bearer = {"unknown": lambda: "e2p_never-issued", "revoked": lambda: revoked_provider_token(api),
              "saved-revoked": lambda: None, "user": lambda: new_user(api)[1].headers["authorization"],
              "worker": lambda: new_worker(api, api.client(provider_token(api)))[1].headers["authorization"]}[kind]()
    token = bearer and bearer.removeprefix("Bearer ")
    proc = join_once(api.url, config, *(["--token", token] if token else []))
    assert proc.returncode == 1, proc.stderr
    assert "measuring generation throughput" not in proc.stderr and registered(api) == []
    source = f"saved in {config / 'credentials.json'}" if kind == "saved-revoked" else \
        "given by --token or ECHO2_PROVIDER_TOKEN"
    if kind in ("user", "worker"):
        said = (f"the token {source} is not a provider token (this route needs a provider token, not a {kind} token): "
                "join needs the e2p_... token the control plane's admin gets by signing the provider up (POST "
                "/v1/providers); pass it with --token or ECHO2_PROVIDER_TOKEN")
    else:
        said = (f"{api.url} does not know the provider token {source} (unknown or revoked token): pass a valid one "
                "with --token e2p_... or ECHO2_PROVIDER_TOKEN=e2p_...")
    assert proc.stderr.strip().splitlines()[-1] == f"echo2-worker: error: {said}"


@pytest.mark.parametrize("provider", ["none saved", "revoked"])
def test_a_saved_worker_that_is_gone_is_said_before_the_benchmark(api: Api, tmp_path: Path, provider: str) -> None:
    """A worker saved by an earlier join and deregistered since: registering again needs a provider token, and
    one missing or no longer valid is said at once, not after the model loaded and the benchmark ran."""
    config = tmp_path / "config"
    saved_provider = revoked_provider_token(api) if provider == "revoked" else None  # the only provider token yet
    worker_id, client = new_worker(api, api.client(provider_token(api)))
    assert client.delete(f"/v1/workers/{worker_id}").status_code in (200, 204)
    token = client.headers["authorization"].removeprefix("Bearer ")
    CredentialStore(config).save(SavedWorker(server=api.url, worker_id=worker_id, worker_token=token,
                                             provider_token=saved_provider))
    proc = join_once(api.url, config)
    assert proc.returncode == 1 and "measuring generation throughput" not in proc.stderr, proc.stderr
    said = proc.stderr.strip().splitlines()[-1]
    if provider == "revoked":
        assert said.startswith(f"echo2-worker: error: {api.url} does not know the provider token saved in ")
    else:
        assert said == (f"echo2-worker: error: the worker saved in {config / 'credentials.json'} is no longer valid "
                        f"on {api.url}: pass --token PROVIDER_TOKEN (or ECHO2_PROVIDER_TOKEN) to register again")


def test_join_refuses_a_server_that_is_not_echo2(tmp_path: Path) -> None:
    """A plain web server (python -m http.server) at --server: said at once, not after a benchmark as its HTML."""
    web = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=web.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{web.server_address[1]}"
    try:
        proc = join_once(url, tmp_path / "config", "--token", "e2p_x")
    finally:
        web.shutdown()
        web.server_close()
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"echo2-worker: error: {url} is not an Echo2 control plane (GET {url}/v1/version answered 404 text/html): "
        "give --server the control plane's base URL, e.g. http://CONTROL_PLANE:8000")


def test_join_refuses_a_server_url_ending_in_v1(tmp_path: Path) -> None:
    proc = join_once("http://127.0.0.1:9/v1/", tmp_path / "config", "--token", "e2p_x")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "echo2-worker: error: --server 'http://127.0.0.1:9/v1' ends in /v1: give the control plane's base URL "
        "without it, --server http://127.0.0.1:9"]


class Answering:
    """A server answering every GET with one status, content type and body."""

    def __init__(self, status: int, kind: str, body: bytes) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> Answering:
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.mark.parametrize(("status", "kind", "body", "refused"), [
    (404, "application/problem+json", b'{"title": "Not Found", "status": 404, "detail": "Not Found"}', None),
    (404, "application/json", b'{"detail": "Not Found"}', "404 application/json"),
    (501, "text/html;charset=utf-8", b"<!DOCTYPE HTML><html><body>Unsupported</body></html>", "501 text/html"),
    (200, "text/html", b"<html>a web app's page for every path</html>", "200 text/html"),
], ids=["echo2-before-v1-version", "other-json-404", "html-501", "html-200"])
def test_only_an_echo2_control_plane_passes_the_version_check(status: int, kind: str, body: bytes,
                                                               refused: str | None,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Echo2 answers every error in problem+json: a 404 so is a control plane from before /v1/version, which is
    joined with a warning; anything else at that URL is another service."""
    with Answering(status, kind, body) as server:
        control = ControlPlane(server.url)
        try:
            if refused is None:
                check_version(control, server.url, "transformers")
                assert "predates /v1/version); joining anyway" in caplog.text
                return
            with pytest.raises(ValueError) as error:
                check_version(control, server.url, "transformers")
        finally:
            control.close()
    assert str(error.value) == (f"{server.url} is not an Echo2 control plane (GET {server.url}/v1/version answered "
                                f"{refused}): give --server the control plane's base URL, e.g. http://CONTROL_PLANE:8000")


def test_join_refuses_more_prompts_a_lease_than_the_protocol_takes():
    """`--max-prompts 512` registered, benchmarked and waited to be activated, then failed on its first lease
    request with a pydantic error (a lease takes 1 to 256)."""
    from echo2_worker.cli import build_parser

    for bad in ("512", "0"):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["join", "--server", "http://127.0.0.1:9", "--max-prompts", bad])
        assert exit_.value.code == 2
    assert build_parser().parse_args(["join", "--server", "http://x", "--max-prompts", "256"]).max_prompts == 256
