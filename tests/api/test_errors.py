"""Bodies and headers the framework cannot parse answer a problem+json the OpenAPI document declares,
never Starlette's bare 400 or text/plain."""

import pytest

from tests.factories import fake_model_folder, new_user, ok, running_job

JSON = {"Content-Type": "application/json"}


def _body_problem(r, reason: str) -> None:
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["errors"] == [{"field": "body", "reason": reason}]
    assert r.json()["detail"] == f"body: {reason}"


@pytest.mark.parametrize("body", [b"\xff\xfe\xfd", '{"name": "caf\xe9", "items": [{"q": "1"}]}'.encode("latin-1")])
def test_a_body_that_is_not_utf8_is_422_on_body(api, body):
    _, alice = new_user(api)
    _body_problem(alice.post("/v1/datasets", content=body, headers=JSON), "body is not valid UTF-8 JSON")
    assert ok(alice.get("/v1/datasets"))["total"] == 0


def test_json_nested_past_the_recursion_limit_is_422_on_body(api):
    _, alice = new_user(api)
    r = alice.post("/v1/datasets", content=b"[" * 100_000 + b"]" * 100_000, headers=JSON)
    _body_problem(r, "body is nested too deeply")


def test_a_malformed_multipart_form_is_422_on_body(api):
    _, alice = new_user(api)
    r = alice.post("/v1/datasets/upload", content=b"--x\r\nnot a part",
                   headers={"Content-Type": "multipart/form-data"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "body", r.text
    assert r.headers["content-type"].startswith("application/problem+json")


def test_chunk_ranges_past_the_end_are_416_and_unparsable_ones_ignored(api, tmp_path):
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    url = f"/v1/jobs/{job['id']}/versions/0/chunks/0"
    whole = alice.get(url)
    size = len(whole.content)
    r = alice.get(url, headers={"Range": f"bytes={size}-"})
    assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{size}"
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["errors"][0]["field"] == "Range"
    for unparsable in ("pages=1-2", "bytes", "bytes=9-3"):
        r = alice.get(url, headers={"Range": unparsable})
        assert r.status_code == 200 and r.content == whole.content, unparsable
