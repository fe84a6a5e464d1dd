"""The SDK examples in examples/, run as a user would run them: real processes, a live control plane."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tasks import get_task
from tasks.base import ScoringError
from tests.conftest import Api
from tests.factories import drive_job, fake_model_folder, new_user, ok

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SAMPLE = EXAMPLES / "data" / "gsm8k_sample.jsonl"


class Script:
    """An example script as a subprocess, its stdout collected line by line as it comes."""

    def __init__(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(EXAMPLES / name), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if m := re.search(pattern, line):
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._changed.wait(0.2)):
                    stderr = self.proc.stderr.read() if self.proc.poll() is not None and self.proc.stderr else ""
                    raise AssertionError(f"no line matching {pattern!r}; got {self.lines} {stderr}")
                self._changed.wait(min(left, 0.5))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def reward_server() -> Iterator[tuple[str, Script]]:
    script = Script("http_reward_server.py", "--port", "0")
    try:
        url = script.wait_for(r"reward server on (http://\S+/reward)", timeout=20).group(1)
        yield url, script
    finally:
        script.stop()


def _user_env(api: Api) -> dict[str, str]:
    _, user = new_user(api)
    key = user.headers["Authorization"].split()[1]
    return {"ECHO2_BASE_URL": api.url, "ECHO2_API_KEY": key}


def test_http_reward_server_scores_through_the_adapter(reward_server):
    url, script = reward_server
    task = get_task("http_reward")
    params = task.parse_params({"url": url, "timeout_s": 5, "max_retries": 1, "backoff_s": 0.01})
    prompt = task.prompt_from_item({"prompt": "What is 6 * 7?", "reference": "42"}, params)
    assert task.reward(prompt, "6 * 7 = 42.\n#### 42", params) == 1.0
    assert task.reward(prompt, "Six sevens. The answer is 42", params) == 1.0
    assert task.reward(prompt, "42 is close, but my answer: 40", params) == 0.5
    assert task.reward(prompt, "#### 41", params) == 0.0
    assert task.reward(prompt, ("pondering " * 200) + "\n#### 42", params) == 0.8  # capped length penalty
    no_reference = task.prompt_from_item({"prompt": "Say something nice."}, params)
    assert task.reward(no_reference, "You are great.", params) == 0.0

    base = url.rsplit("/", 1)[0]
    with httpx.Client(timeout=5) as http:
        assert http.get(f"{base}/healthz").json() == {"status": "ok"}
        bad = http.post(url, content=b"not json", headers={"Content-Type": "application/json"})
        assert bad.status_code == 400 and "JSON" in bad.json()["error"]
        wrong = http.post(url, json={"prompt": "p", "completion": 3})
        assert wrong.status_code == 400 and "completion" in wrong.json()["error"]
        assert http.post(f"{base}/other", json={}).status_code == 404
    # A 4xx is not retried by the adapter: the sample cannot be scored, said at once (the learner leaves it unscored).
    with pytest.raises(ScoringError, match="answered HTTP 404"):
        task.reward(prompt, "x", task.parse_params({"url": f"{base}/other", "max_retries": 3}))

    script.proc.send_signal(signal.SIGTERM)
    assert script.proc.wait(timeout=10) == 0


def test_jsonl_dataset_uploads_and_creates_a_gsm8k_job(api):
    env = _user_env(api)
    run = subprocess.run([sys.executable, str(EXAMPLES / "jsonl_dataset.py"), str(SAMPLE), "--steps", "5"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert run.returncode == 0, run.stderr
    dataset_id = re.search(r"^dataset (\S+): 12 items, keys answer, question$", run.stdout, re.M).group(1)
    job_id = re.search(r"^job (\S+): queued, task gsm8k on 11 training prompts \(10% held out", run.stdout,
                       re.M).group(1)

    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {env['ECHO2_API_KEY']}"}) as user:
        job = ok(user.get(f"/v1/jobs/{job_id}"))
        assert job["spec"]["dataset_id"] == dataset_id and job["spec"]["task"]["name"] == "gsm8k"
        assert job["spec"]["max_steps"] == 5 and job["num_prompts"] == 11  # one of 12 held out
        prompts = ok(user.get(f"/v1/jobs/{job_id}/prompts", params={"limit": 50}))["items"]
        first = json.loads(SAMPLE.read_text().splitlines()[0])["question"]
        assert any(first in p["text"] for p in prompts)
        assert ok(user.get(f"/v1/datasets/{dataset_id}"))["num_items"] == 12


def test_jsonl_dataset_names_the_line_that_does_not_fit(api, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n{"question": "no answer here"}\n')
    run = subprocess.run([sys.executable, str(EXAMPLES / "jsonl_dataset.py"), str(bad)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, **_user_env(api)})
    assert run.returncode == 1
    assert "Traceback" not in run.stderr and "item 1" in run.stderr and "answer" in run.stderr
    missing = subprocess.run([sys.executable, str(EXAMPLES / "jsonl_dataset.py"), str(tmp_path / "nope.jsonl")],
                             capture_output=True, text=True, timeout=60, env={**os.environ, **_user_env(api)})
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_submit_and_watch_follows_the_job_until_it_is_cancelled(api, tmp_path):
    env = _user_env(api)
    script = Script("submit_and_watch.py", "--steps", "3", "--staleness", "1", "--group-size", "2",
                    "--prompts-per-step", "2", "--poll-interval", "0.2", env=env)
    try:
        job_id = script.wait_for(r"^submitted job (\S+) \(arithmetic on echo2:tiny, S=1, 3 steps\)").group(1)
        script.wait_for(rf"job {job_id} is queued")
        drive_job(api, job_id, fake_model_folder(tmp_path / "model"), t_train_s=0.25)  # learner + worker, step 0
        script.wait_for(rf"job {job_id} is running")
        line = script.wait_for(r"^step +1/3 +reward 0\.500 +staleness max 0 \(mean 0\.0\) +groups 2").string
        assert "0.25 s/step" in line
        assert script.proc.poll() is None  # still watching a running job

        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {env['ECHO2_API_KEY']}"}) as user:
            ok(user.post(f"/v1/jobs/{job_id}/cancel"))
        assert script.proc.wait(timeout=20) == 1
        script.wait_for(rf"job {job_id} is cancelled")
        script.wait_for(rf"^job {job_id} cancelled: 1 steps, reward 0\.500 -> 0\.500")
    finally:
        script.stop()


def test_calculator_env_plays_a_tool_using_episode_through_the_adapter(tmp_path):
    script = Script("calculator_env.py", "--port", "0")
    try:
        url = script.wait_for(r"calculator environment on (http://\S+/step)", timeout=20).group(1)
        task = get_task("http_env")
        params = task.parse_params({"url": url, "max_turns": 4, "timeout_s": 5, "max_retries": 1})
        exported = tmp_path / "prompts.jsonl"
        subprocess.run([sys.executable, str(EXAMPLES / "calculator_env.py"), "--export-prompts", str(exported),
                        "--count", "3"], check=True)
        items = [json.loads(line) for line in exported.read_text().splitlines()]
        assert len(items) == 3 and all("calc(" in i["prompt"] and i["reference"].isdigit() for i in items)
        prompt = task.prompt_from_item({"prompt": "What is 37*41+5?", "reference": "1522"}, params)

        def play(*actions: str):
            episode = task.new_episode(prompt, params)
            assert episode.reset() == "What is 37*41+5?"
            return [(t.observation, t.done, t.reward) for t in map(episode.step, actions)]

        assert play("calc(37*41)", "calc(1517+5)", "answer: 1522") == [
            ("calc(37*41) = 1517", False, None), ("calc(1517+5) = 1522", False, None), (None, True, 1.0)]
        assert play("answer: 1500") == [(None, True, 0.0)]
        assert play("I do not know.") == [(None, True, 0.0)]  # neither a call nor an answer
        # The model's text is untrusted: no eval, no runaway power, no crash on nonsense.
        assert play("calc(__import__('os').getpid())")[0][0].startswith("calc(__import__('os').getpid()) = error:")
        assert play("calc(9**9**9)")[0][0] == "calc(9**9**9) = error: exponent larger than 64"
        assert play("calc(1/0)")[0][0] == "calc(1/0) = error: division by zero"
        assert play("calc(1)", "calc(2)", "calc(3)", "calc(4)")[-1] == (None, True, 0.0)  # out of tool calls
    finally:
        script.stop()
