"""NaN and ±Infinity, which Python's json module reads from a body, are refused with a 422 naming the
field wherever the API takes a number, and nothing of the request is stored."""

import json

import pytest

from tests.factories import activate, fake_model_folder, job_spec, new_provider, new_user, new_worker, ok, running_job

NON_FINITE = ["NaN", "Infinity", "-Infinity"]
JSON = {"Content-Type": "application/json"}


def _post(client, url: str, body: dict, value: str):
    """POST `body` with the placeholder string "@" written as the bare JSON token `value`."""
    return client.post(url, content=json.dumps(body).replace('"@"', value), headers=JSON)


def _refused(r, field: str) -> None:
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["errors"][0]["field"] == field, r.json()


@pytest.mark.parametrize("value", NON_FINITE)
def test_dataset_items(api, value):
    _, alice = new_user(api)
    body = {"name": "d", "items": [{"question": "1+1?", "answer": "2"}, {"question": "q", "answer": "@"}]}
    r = _post(alice, "/v1/datasets", body, value)
    _refused(r, "body.items.1.answer")  # our validator's own words, without pydantic's "Value error, "
    assert r.json()["errors"][0]["reason"] == "must be a finite number, not NaN or Infinity"
    line = json.dumps({"question": "q", "answer": "@"}).replace('"@"', value)
    r = alice.post("/v1/datasets/upload", data={"name": "d"}, files={"file": ("d.jsonl", f'{{"q": "1"}}\n{line}\n')})
    _refused(r, "file")
    assert "line 2" in r.json()["detail"] and "finite" in r.json()["detail"]
    assert ok(alice.get("/v1/datasets"))["total"] == 0


@pytest.mark.parametrize("value", NON_FINITE)
def test_inline_prompts_and_task_params(api, value):
    _, alice = new_user(api)
    spec = job_spec(task={"name": "gsm8k"}, num_prompts=None, prompts=[{"item": {"question": "q", "answer": "@"}}])
    _refused(_post(alice, "/v1/jobs", spec, value), "body.prompts.0.item.answer")
    r = _post(alice, "/v1/jobs", job_spec(task={"name": "arithmetic", "params": {"max_operand": "@"}}), value)
    assert r.status_code == 422 and r.json()["errors"][0]["field"].startswith("body.task.params.max_operand")
    r = _post(alice, "/v1/jobs", job_spec(budget_usd="@"), value)
    _refused(r, "body.budget_usd")
    assert r.json()["errors"][0]["reason"] == "Input should be a finite number"
    assert ok(alice.get("/v1/jobs"))["total"] == 0


@pytest.mark.parametrize("value", NON_FINITE)
def test_worker_heartbeat_stats(api, value):
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    r = _post(worker, f"/v1/workers/{wid}/heartbeat", {"stats": {"tokens_per_s": "@"}}, value)
    _refused(r, "body.stats.tokens_per_s")
    assert ok(api.admin.get(f"/v1/workers/{wid}"))["last_heartbeat_at"] is None


@pytest.mark.parametrize("value", NON_FINITE)
def test_rollout_submit(api, tmp_path, value):
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}), 201)
    sample = {"token_ids": [5, 6], "logprobs": [-0.5, -1.0], "text": "42", "finish_reason": "stop"}
    group = {"prompt_id": lease["prompts"][0]["prompt_id"], "version": 0, "prompt_token_ids": [1, 2, 3],
             "samples": [sample, sample]}
    url = f"/v1/leases/{lease['id']}/rollouts"
    _refused(_post(worker, url, {"groups": [{**group, "gen_seconds": "@"}]}, value), "body.groups.0.gen_seconds")
    bad = {**sample, "logprobs": [-0.5, "@"]}
    _refused(_post(worker, url, {"groups": [{**group, "samples": [sample, bad]}]}, value),
             "body.groups.0.samples.1.logprobs.1")
    assert ok(alice.get(f"/v1/jobs/{job['id']}/rollouts"))["total"] == 0
