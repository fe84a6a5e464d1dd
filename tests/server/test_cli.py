"""`echo2-server` as an operator runs it: real subprocesses on a fresh data directory."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx

from server.local import free_port, wait_port


def run(args, env, **kw):
    return subprocess.run([sys.executable, "-m", "server.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120, **kw)


def test_db_upgrade_and_create_user(tmp_path):
    env = {**os.environ, "ECHO2_DATA_DIR": str(tmp_path)}
    done = run(["db", "upgrade"], env)
    assert done.returncode == 0 and "latest schema" in done.stdout
    assert (tmp_path / "echo2.db").exists()
    made = run(["admin", "create-user", "--name", "alice"], env)
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith("created user ")  # not an admin unless asked for
    assert made.stdout.strip().splitlines()[-1].startswith("e2u_")
    assert str(tmp_path / "echo2.db") in made.stdout and "note:" not in made.stderr  # the database it wrote to
    ops = run(["admin", "create-user", "--name", "ops", "--role", "admin"], env)
    assert ops.returncode == 0 and ops.stdout.startswith("created admin "), ops.stderr


def test_a_user_made_in_a_database_no_server_has_yet_says_so(tmp_path):
    """Run outside the server's folder, create-user made a new database there and printed a key every server
    refused, without a word."""
    elsewhere = run(["admin", "create-user", "--name", "bob"], {**os.environ, "ECHO2_DATA_DIR": str(tmp_path / "x")})
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert str(tmp_path / "x" / "echo2.db") in elsewhere.stdout
    assert "did not exist, so this made a new, empty one" in elsewhere.stderr


def test_errors_are_one_line(tmp_path):
    env = {**os.environ, "ECHO2_DATA_DIR": str(tmp_path), "ECHO2_DATABASE_URL": "postgresql+psycopg://x@127.0.0.1:1/x"}
    done = run(["db", "upgrade"], env)
    assert done.returncode == 1
    assert done.stderr.startswith("echo2-server: error:") and "Traceback" not in done.stderr


def test_production_refuses_sqlite(tmp_path):
    env = {**os.environ, "ECHO2_DATA_DIR": str(tmp_path), "ECHO2_ENV": "production"}
    done = run(["db", "upgrade"], env)
    assert done.returncode == 1 and "PostgreSQL" in done.stderr


def test_api_first_run_creates_an_admin_key(tmp_path):
    port = free_port()
    env = {**os.environ, "ECHO2_DATA_DIR": str(tmp_path), "ECHO2_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "api"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_port(port, timeout=60, proc=proc)
        key = (tmp_path / "admin.key").read_text().strip()
        assert oct((tmp_path / "admin.key").stat().st_mode)[-3:] == "600"
        me = httpx.get(f"http://127.0.0.1:{port}/v1/me", headers={"Authorization": f"Bearer {key}"})
        assert me.status_code == 200 and me.json()["role"] == "admin"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert "admin.key" in out


def test_help_is_fast():
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "server.cli", "--help"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "echo2-server" in done.stdout
    assert time.perf_counter() - start < 2.0


def test_api_logs_json_lines_when_asked(tmp_path):
    port = free_port()
    env = {**os.environ, "ECHO2_DATA_DIR": str(tmp_path), "ECHO2_PORT": str(port), "ECHO2_LOG_FORMAT": "json"}
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "api"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_port(port, timeout=60, proc=proc)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    lines = [json.loads(line) for line in err.splitlines()]  # every line, uvicorn's included
    assert {"ts", "level", "logger", "msg"} <= set(lines[0])
    assert any(x["logger"] == "uvicorn.error" and x["msg"].startswith("Uvicorn running on") for x in lines)


def test_several_api_processes_need_postgresql(tmp_path):
    env = {**os.environ, "ECHO2_DATA_DIR": str(tmp_path)}
    for args in (["api", "--workers", "2"], ["up", "--api-processes", "2"], ["up", "--api-processes", "0"]):
        done = run(args, env)
        assert done.returncode == 1 and done.stderr.startswith("echo2-server: error:"), (args, done.stderr)
    assert "ECHO2_DATABASE_URL" in run(["up", "--api-processes", "2"], env).stderr
    assert not (tmp_path / "echo2.db").exists()  # refused before anything was made


def test_up_on_a_port_another_program_holds_is_refused(tmp_path):
    """It said "Echo2 is up" with the other program's listener on its port, while its API failed to bind and
    restarted every 2 s."""
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        done = run(["up", "--workers", "0", "--port", str(port)], {**os.environ, "ECHO2_DATA_DIR": str(tmp_path)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"port {port} on 127.0.0.1 is taken by another program" in done.stderr and "--port" in done.stderr
    assert "Echo2 is up" not in done.stdout and not list((tmp_path / "run").glob("*.pid"))


def test_up_on_another_port_keeps_the_public_url_it_was_given(tmp_path):
    """`up --port P` replaced ECHO2_PUBLIC_URL with http://HOST:P, so the address remote workers were told was
    lost; and a public URL of 0.0.0.0 (what ECHO2_HOST=0.0.0.0 gives) is a note, since a remote worker reads it as
    itself."""
    port = free_port()
    env = {**os.environ, "ECHO2_DATA_DIR": str(tmp_path), "ECHO2_PUBLIC_URL": f"http://0.0.0.0:{port}"}
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "up", "--workers", "0", "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline() + proc.stdout.readline()
        assert f"Echo2 is up: dashboard http://0.0.0.0:{port}/" in banner, banner
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert "workers on other machines are told to reach this control plane at" in err and "ECHO2_PUBLIC_URL" in err
