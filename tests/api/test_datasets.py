import json

from tests.factories import job_spec, new_user, ok


def test_create_read_use_delete_dataset(api):
    _, alice = new_user(api)
    items = [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"} for i in range(5)]
    ds = ok(alice.post("/v1/datasets", json={"name": "sums", "items": items}), 201)
    assert ds["num_items"] == 5 and ds["keys"] == ["answer", "question"]
    page = ok(alice.get(f"/v1/datasets/{ds['id']}/items", params={"limit": 2, "offset": 1}))
    assert page["items"] == items[1:3] and page["next_offset"] == 3
    assert ok(alice.get("/v1/datasets"))["total"] == 1
    job = ok(alice.post("/v1/jobs", json=job_spec(task={"name": "gsm8k"}, dataset_id=ds["id"])), 201)
    assert job["num_prompts"] == 5
    assert alice.delete(f"/v1/datasets/{ds['id']}").status_code == 204
    assert alice.get(f"/v1/datasets/{ds['id']}").status_code == 404


def test_jsonl_upload_and_line_errors(api, tmp_path):
    _, alice = new_user(api)
    good = "\n".join(json.dumps({"question": "1+1?", "answer": "2"}) for _ in range(3)) + "\n\n"
    ds = ok(alice.post("/v1/datasets/upload", data={"name": "up"}, files={"file": ("d.jsonl", good)}), 201)
    assert ds["num_items"] == 3
    bad = alice.post("/v1/datasets/upload", data={"name": "up"},
                     files={"file": ("d.jsonl", '{"question": "ok"}\n{oops\n')})
    assert bad.status_code == 422 and "line 2" in bad.json()["detail"]
    assert ok(alice.get("/v1/datasets"))["total"] == 1


def test_datasets_are_private(api):
    _, alice = new_user(api)
    _, bob = new_user(api, "bob")
    ds = ok(alice.post("/v1/datasets", json={"name": "s", "items": [{"question": "q", "answer": "1"}]}), 201)
    assert bob.get(f"/v1/datasets/{ds['id']}").status_code == 404
    assert bob.get(f"/v1/datasets/{ds['id']}/items").status_code == 404
    assert bob.delete(f"/v1/datasets/{ds['id']}").status_code == 404
    r = bob.post("/v1/jobs", json=job_spec(task={"name": "gsm8k"}, dataset_id=ds["id"]))
    assert r.status_code == 404 and r.json()["errors"][0]["field"] == "dataset_id"


def test_item_values_are_stored_as_sent(api):
    _, alice = new_user(api)
    item = {"question": "q", "answer": "1", "flag": True, "n": 3, "x": 0.5, "none": None}
    dataset = ok(alice.post("/v1/datasets", json={"name": "kinds", "items": [item]}), 201)
    assert ok(alice.get(f"/v1/datasets/{dataset['id']}/items"))["items"] == [item]


def test_a_dataset_smaller_than_one_step_is_refused_or_with_the_flag_reused(api):
    """9 items with 16 prompts per step used to sit at "9 waiting", billing the learner, until cancelled."""
    _, alice = new_user(api)
    items = [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"} for i in range(9)]
    ds = ok(alice.post("/v1/datasets", json={"name": "nine", "items": items}), 201)
    spec = job_spec(task={"name": "gsm8k"}, dataset_id=ds["id"], num_prompts=None,
                    grpo={"group_size": 2, "prompts_per_step": 16})
    refused = alice.post("/v1/jobs", json=spec)
    assert refused.status_code == 422 and refused.json()["errors"][0]["field"] == "grpo.prompts_per_step"
    assert refused.json()["detail"].startswith("9 training prompts are fewer than one step's "
                                               "grpo.prompts_per_step = 16")
    assert "set reuse_prompts to true" in refused.json()["detail"]
    assert ok(alice.get("/v1/jobs"))["total"] == 0
    job = ok(alice.post("/v1/jobs", json={**spec, "reuse_prompts": True}), 201)
    assert job["num_prompts"] == 18  # each item twice: a step of 16 groups can be leased
    texts = [p["text"] for p in ok(alice.get(f"/v1/jobs/{job['id']}/prompts", params={"limit": 50}))["items"]]
    assert len(texts) == 18 and len(set(texts)) == 9


def test_a_dataset_over_the_body_limit_is_refused_naming_the_limit_in_mib(api):
    _, alice = new_user(api)
    line = json.dumps({"question": "1+1?" + " " * 1000, "answer": "2"}) + "\n"
    big = line * (api.server.settings.max_body_bytes // len(line) + 1)
    r = alice.post("/v1/datasets/upload", data={"name": "big"}, files={"file": ("d.jsonl", big)})
    assert r.status_code == 413 and r.json()["errors"][0]["field"] == "body"
    assert r.json()["detail"].startswith("the dataset is larger than this server's limit of 16 MiB per request: "
                                         "send it in parts (POST /v1/datasets/uploads")
    assert ok(alice.get("/v1/datasets"))["total"] == 0
