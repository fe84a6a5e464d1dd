"""Bodies, headers and path parameters the framework cannot parse or the database cannot hold answer a
problem+json the OpenAPI document declares, never Starlette's bare 400, text/plain or a 500."""

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


# A tenant's id in a URL path that holds a NUL byte (a pasted id with a stray control character, `%00`) was a 500
# on PostgreSQL, the production database, where every other malformed input is a 4xx problem naming it.
TENANT_ROUTES = [
    ("GET", "/v1/jobs/{id}"),
    ("GET", "/v1/jobs/{id}/ledger"),
    ("GET", "/v1/jobs/{id}/rollouts"),
    ("POST", "/v1/jobs/{id}/cancel"),
    ("GET", "/v1/jobs/{id}/export"),
    ("GET", "/v1/datasets/{id}"),
    ("DELETE", "/v1/datasets/{id}"),
    ("GET", "/v1/workers/{id}"),
]


@pytest.mark.parametrize(("method", "route"), TENANT_ROUTES)
def test_an_id_with_a_nul_byte_in_the_path_is_a_4xx_problem_not_a_server_error(api, method, route):
    """The id names nothing the caller owns: the answer is the route's 404 (or a 422 on the id), as for any other
    unknown id, never an unhandled database error."""
    _, alice = new_user(api)
    r = alice.request(method, route.format(id="job_1234%00abcd"))
    assert r.status_code < 500, f"{method} {route} with %00 in the id: {r.status_code} {r.text[:200]}"
    assert r.headers["content-type"].startswith("application/problem+json")


def test_a_nul_byte_in_a_path_parameter_is_422_naming_it(api):
    """Checked for every route at once (api/routing.py), worded as for a body field with a NUL in it."""
    _, alice = new_user(api)
    r = alice.get("/v1/jobs/job_1234%00abcd/rollouts/r%00")
    reason = "must not contain NUL (\\x00) characters"
    assert r.status_code == 422, r.text
    assert r.json()["errors"] == [{"field": "path.job_id", "reason": reason},
                                  {"field": "path.rollout_id", "reason": reason}]
    assert r.json()["detail"] == f"path.job_id: {reason}"


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
