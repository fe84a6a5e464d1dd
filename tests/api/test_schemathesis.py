"""Property-based run of schemathesis against the live OpenAPI document, once per kind of caller
(admin, provider, worker on a running job, learner), so each route is reached with a token that may
pass its auth. Zero server errors are allowed, and every answer must be one the document declares for its
operation: its status code, its content type and its body's schema."""

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import ADMIN_KEY
from tests.factories import activate, fake_model_folder, new_provider, new_user, new_worker, ok, publish

MIN_CASES = 1000
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def _tokens(api, tmp_path) -> dict[str, str]:
    _, alice = new_user(api)
    job = ok(alice.post("/v1/jobs", json={"name": "st", "base_model": "echo2:tiny", "task": {"name": "arithmetic"},
                                          "num_prompts": 20}), 201)
    learner = ok(api.admin.post(f"/v1/jobs/{job['id']}/learner/token"), 201)["token"]
    provider = ok(api.admin.post("/v1/providers", json={"name": "st"}), 201)["token"]
    _, provider_client = new_provider(api, "st2")
    wid, worker_client = new_worker(api, provider_client)
    activate(api, wid, job["id"])
    publish(api.client(learner), job["id"], fake_model_folder(tmp_path / "m"), version=0, step=0)
    worker = worker_client.headers["Authorization"].split()[1]
    return {"admin": ADMIN_KEY, "provider": provider, "worker": worker, "learner": learner}


def _run(url: str, token: str) -> tuple[int, str]:
    # One worker thread a run, two runs at a time: hypothesis describes strategies with ast.parse, which on
    # CPython 3.11 fails ("AST constructor recursion depth mismatch") when two threads parse at once.
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json",
           "--header", f"Authorization: Bearer {token}",
           "--checks", CHECKS,
           "--max-examples", "5", "--workers", "1", "--generation-deterministic",
           "--phases", "examples,coverage,fuzzing"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.postgres_only
def test_schemathesis_finds_no_server_errors_or_undocumented_answers(api, tmp_path):
    total = 0
    tokens = _tokens(api, tmp_path)
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(tokens, pool.map(lambda token: _run(api.url, token), tokens.values()), strict=True))
    for who, (code, out) in runs.items():
        assert code == 0, f"schemathesis as {who} failed:\n{out[-6000:]}"
        match = re.search(r"(\d+) generated, (\d+) passed", out)
        assert match and match.group(1) == match.group(2), out[-3000:]
        total += int(match.group(1))
    assert total >= MIN_CASES
