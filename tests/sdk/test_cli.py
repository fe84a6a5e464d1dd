"""The `echo2` command in a subprocess against the live control plane."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from echo2.protocol import JobRead
from sqlalchemy import select

from api.models import DatasetUpload
from tests.conftest import ADMIN_KEY

from .conftest import SPEC, long_job

HEAVY = ("pydantic", "httpx", "api", "fastapi", "sqlalchemy", "torch", "transformers", "learner")


def echo2(*args: str, key: str | None = None, url: str | None = None, stdin: str | None = None,
          timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ECHO2_")}
    if url:
        env["ECHO2_BASE_URL"] = url
    if key:
        env["ECHO2_API_KEY"] = key
    return subprocess.run([sys.executable, "-m", "echo2.cli", *args], capture_output=True, text=True, env=env,
                          input=stdin, timeout=timeout)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("echo2")
    return lines[0]


def test_help_is_fast_and_imports_nothing_heavy():
    started = time.monotonic()
    result = echo2("--help")
    assert result.returncode == 0 and "jobs" in result.stdout and "checkpoints" in result.stdout
    assert time.monotonic() - started < 1.0
    probe = ("import sys\nfrom echo2.cli import main\n"
             "for argv in (['--help'], ['jobs', 'submit', '--help'], ['jobs', 'watch', '--help']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_submit_list_get_cancel(api, alice, tmp_path):
    url, key = api.url, alice.key
    submitted = echo2("jobs", "submit", "--model", "echo2:tiny", "--task", "arithmetic", "--steps", "4",
                      "--staleness", "1", "--group-size", "2", "--prompts-per-step", "2",
                      "--num-prompts", "6", "--set", "grpo.kl_coef=0.01", "--json", url=url, key=key)
    assert submitted.returncode == 0, submitted.stderr
    job = JobRead.model_validate_json(submitted.stdout)
    assert job.spec.max_steps == 4 and job.spec.grpo.kl_coef == 0.01 and job.num_prompts == 6
    assert job.spec.name == "arithmetic-echo2-tiny"

    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(SPEC))
    human = echo2("jobs", "submit", "--file", str(spec_file), "--name", "from-file", url=url, key=key)
    assert human.returncode == 0 and human.stdout.startswith("submitted job ")
    from_stdin = echo2("jobs", "submit", "-f", "-", "--steps", "2", "--json", url=url, key=key,
                       stdin=json.dumps(SPEC))
    assert JobRead.model_validate_json(from_stdin.stdout).spec.max_steps == 2

    listed = echo2("jobs", "list", url=url, key=key)
    assert listed.returncode == 0 and job.id in listed.stdout and "from-file" in listed.stdout
    header = ["ID", "NAME", "STATUS", "STEP", "REWARD", "COST", "CREATED"]
    assert listed.stdout.splitlines()[0].split() == header
    page = json.loads(echo2("jobs", "list", "--json", "--limit", "1", url=url, key=key).stdout)
    assert page["total"] == 3 and len(page["items"]) == 1

    got = echo2("jobs", "get", job.id, "--json", url=url, key=key)
    assert JobRead.model_validate_json(got.stdout).id == job.id
    shown = echo2("jobs", "get", job.id, url=url, key=key).stdout
    assert "status" in shown and "queued" in shown and "0/4" in shown

    budget = echo2("jobs", "budget", job.id, "2.5", url=url, key=key)
    assert budget.returncode == 0 and f"job {job.id} queued, budget $2.50" in budget.stdout
    assert JobRead.model_validate_json(echo2("jobs", "budget", job.id, "none", "--json", url=url,
                                             key=key).stdout).spec.budget_usd is None
    assert "expected an amount" in one_line_error(echo2("jobs", "budget", job.id, "lots", url=url, key=key))

    cancelled = echo2("jobs", "cancel", job.id, url=url, key=key)
    assert cancelled.returncode == 0 and f"job {job.id} cancelled" in cancelled.stdout
    again = one_line_error(echo2("jobs", "cancel", job.id, url=url, key=key))
    assert "409" in again and "already cancelled" in again


def test_global_flags_override_the_environment(api, alice):
    result = echo2("--base-url", api.url, "--api-key", alice.key, "jobs", "list", "--json",
                   url="http://127.0.0.1:9", key="wrong")
    assert result.returncode == 0 and json.loads(result.stdout)["total"] == 0
    after = echo2("jobs", "list", "--json", "--api-key", alice.key, url=api.url, key="wrong")
    assert after.returncode == 0, after.stderr


def test_errors_are_one_line(api, alice):
    url, key = api.url, alice.key
    bad_int = one_line_error(echo2("jobs", "submit", "--model", "m", "--task", "arithmetic",
                                   "--steps", "many", url=url, key=key))
    assert "--steps" in bad_int
    bad_value = one_line_error(echo2("jobs", "submit", "--model", "echo2:tiny", "--task", "arithmetic",
                                     "--staleness", "-1", url=url, key=key))
    assert "staleness" in bad_value
    unknown_task = one_line_error(echo2("jobs", "submit", "--model", "echo2:tiny", "--task", "nope",
                                        url=url, key=key))
    assert "422" in unknown_task and "task.name" in unknown_task
    assert "give --file" in one_line_error(echo2("jobs", "submit", "--steps", "3", url=url, key=key))
    misnamed = one_line_error(echo2("jobs", "submit", "-f", "-", url=url, key=key,  # "give --file" said nothing
                                    stdin=json.dumps({"model": "echo2:tiny", "task": "arithmetic", "steps": 5})))
    assert "base_model" in misnamed and "give --file" not in misnamed, misnamed
    assert "404" in one_line_error(echo2("jobs", "get", "nope", url=url, key=key))
    assert "401" in one_line_error(echo2("jobs", "list", url=url, key="e2u_wrong"))
    assert "ECHO2_API_KEY" in one_line_error(echo2("jobs", "list", url=url))
    no_model = one_line_error(echo2("jobs", "submit", "--model", "echo2:huge", "--task", "arithmetic", url=url,
                                    key=key))
    assert no_model.count("unknown built-in model") == 1 and "422 Unprocessable Entity: base_model: unknown" in no_model
    statement = one_line_error(echo2("providers", "statement", url=url, key=ADMIN_KEY))
    assert "403" in statement and "name the provider with --provider PROVIDER_ID" in statement
    missing = echo2("datasets", "upload", "d", "/nonexistent.jsonl", url=url, key=key)
    assert one_line_error(missing) == "echo2: error: /nonexistent.jsonl does not exist"
    assert echo2("jobs", "frobnicate").returncode == 2


def test_metrics_shows_every_step(api, alice):
    """The server answers at most a page of steps a call; `echo2 jobs metrics` of a 1,200-step job printed steps
    0-999 with no word that the rest were left out."""
    jid = long_job(api, alice, 1200)
    out = echo2("jobs", "metrics", jid, url=api.url, key=alice.key)
    assert out.returncode == 0, out.stderr
    shown = [line.split()[0] for line in out.stdout.splitlines()[1:]]
    assert shown == [str(i) for i in range(1200)], f"printed {len(shown)} rows, the last step {shown[-1]}"
    tail = echo2("jobs", "metrics", jid, "--since", "1100", url=api.url, key=alice.key)
    assert [line.split()[0] for line in tail.stdout.splitlines()[1:]] == [str(i) for i in range(1100, 1200)]


def test_watch_follows_a_job_to_the_end(api, alice, driven):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ECHO2_")},
           "ECHO2_BASE_URL": api.url, "ECHO2_API_KEY": alice.key}
    with subprocess.Popen([sys.executable, "-m", "echo2.cli", "jobs", "watch", driven.id, "--interval", "0.2"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as watch:
        assert watch.stdout is not None
        first = watch.stdout.readline()  # the job ends only once the watch has seen it running
        driven.finish()
        rest, err = watch.communicate(timeout=60)
    assert watch.returncode == 0, err
    lines = (first + rest).strip().splitlines()
    assert "running" in lines[0] and "1/3 steps done" in lines[0] and "staleness 0.50 (S=1)" in lines[0]
    assert "reward 0.500" in lines[0] and "cost $" in lines[0]
    assert "held-out -" in lines[0]  # the driven job reports no evaluation
    progress = [line.rsplit("  cost $", 1)[0] for line in lines[:-3]]
    assert all(a != b for a, b in zip(progress, progress[1:], strict=False))  # a new line only for a change
    assert lines[-3].startswith(f"job {driven.id} succeeded")
    assert lines[-2].startswith("learner busy ") and "groups: 2 generated, 2 trained, 0 waiting" in lines[-2]
    assert lines[-1] == ("held-out accuracy: none reported yet (the learner evaluates the base model first; a job "
                         "that holds no prompts out reports none)")
    report = echo2("jobs", "report", driven.id, url=api.url, key=alice.key)
    assert report.returncode == 0 and report.stdout.strip().splitlines() == lines[-2:]


def test_watch_exit_status_and_timeout(api, alice):
    job = alice.client.jobs.create(SPEC)
    timed_out = one_line_error(echo2("jobs", "watch", job.id, "--interval", "0.1", "--timeout", "0.3",
                                     url=api.url, key=alice.key))
    assert "still queued" in timed_out
    alice.client.jobs.cancel(job.id)
    result = echo2("jobs", "watch", job.id, url=api.url, key=alice.key)
    assert result.returncode == 1 and "cancelled" in result.stdout


def test_datasets_tasks_and_checkpoints(api, alice, driven, tmp_path):
    url, key = api.url, alice.key
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": "#### 4"}\n')
    up = echo2("datasets", "upload", "tiny", str(data), url=url, key=key)
    assert up.returncode == 0 and "2 items" in up.stdout, up.stderr
    assert "tiny" in echo2("datasets", "list", url=url, key=key).stdout
    tasks = echo2("tasks", "list", "--json", url=url, key=key)
    assert "arithmetic" in {t["name"] for t in json.loads(tasks.stdout)}
    dest = tmp_path / "ckpt"
    down = echo2("checkpoints", "download", driven.id, str(dest), url=url, key=key)
    assert down.returncode == 0 and "downloaded 2 files" in down.stdout, down.stderr
    assert (dest / "config.json").read_bytes() == (driven.folder / "config.json").read_bytes()
    again = echo2("checkpoints", "download", driven.id, str(dest), url=url, key=key)
    assert "not empty" in one_line_error(again)
    metrics = echo2("jobs", "metrics", driven.id, url=url, key=key)
    assert metrics.returncode == 0 and metrics.stdout.splitlines()[1].split()[:2] == ["0", "0.500"]


SCRIPT = Path(sys.executable).parent / "echo2"


@pytest.mark.skipif(not SCRIPT.exists(), reason="console script not installed")
def test_console_script(api):
    script = SCRIPT
    result = subprocess.run([str(script), "--api-key", ADMIN_KEY, "--base-url", api.url, "jobs", "list"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "(none)" in result.stdout, result.stderr


def test_a_refused_upload_is_one_line_naming_each_bad_line_once_and_leaves_nothing_behind(api, alice, tmp_path):
    url, key = api.url, alice.key
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n["a list"]\n')
    result = echo2("datasets", "upload", "mybad", str(bad), url=url, key=key)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    refused = result.stderr.strip().splitlines()[-1]  # after the progress bar's lines
    assert refused.startswith("echo2: error: HTTP 422 Unprocessable Entity: 2 bad lines of 3: line 2: not valid JSON")
    assert refused.count("line 2") == 1 and refused.count("line 3") == 1 and "(also" not in refused
    with api.db.session() as s:
        assert s.scalars(select(DatasetUpload).where(DatasetUpload.owner_id == alice.id)).all() == []
    bad.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    fixed = echo2("datasets", "upload", "mybad", str(bad), url=url, key=key)
    assert fixed.returncode == 0 and "2 items" in fixed.stdout, fixed.stderr


def test_a_base_url_that_is_no_echo2_server_is_a_one_line_error_saying_so(api, alice, plain_http):
    with_v1 = one_line_error(echo2("--base-url", f"{api.url}/v1", "jobs", "list", key=alice.key))
    assert with_v1 == (f"echo2: error: base URL '{api.url}/v1' ends in /v1: give the server's base URL without it, "
                       f"'{api.url}' (ECHO2_BASE_URL or --base-url)")
    elsewhere = one_line_error(echo2("--base-url", plain_http, "jobs", "list", key=alice.key))
    assert elsewhere.startswith(f"echo2: error: HTTP 404 File not found: the server at {plain_http} answered GET "
                                "/v1/jobs with text/html")
    assert "does not look like an Echo2 control plane" in elsewhere and "<" not in elsewhere


def test_an_unknown_option_points_to_the_help_of_its_command():
    result = echo2("jobs", "submit", "--bogus", "1", url="http://127.0.0.1:9", key="k")
    assert result.returncode == 2
    assert one_line_error(result) == "echo2: error: unrecognized arguments: --bogus 1 (see echo2 jobs submit --help)"
