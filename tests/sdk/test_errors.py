"""Real server answers map onto one exception class per status family, with problem+json fields."""

from __future__ import annotations

import json

import pytest
from echo2 import (
    APIStatusError,
    AuthenticationError,
    BadRequestError,
    Client,
    ConfigurationError,
    ConflictError,
    ConnectionError,
    Echo2Error,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    ServerError,
    UnexpectedResponseError,
)

from server.local import free_port

from .conftest import SPEC
from .stub import Reply


def test_bad_key_is_an_authentication_error(api):
    with Client(api.url, "e2u_not-a-real-key") as client, pytest.raises(AuthenticationError) as info:
        client.jobs.list()
    err = info.value
    assert isinstance(err, APIStatusError) and isinstance(err, Echo2Error)
    assert err.status == 401 and err.title == "Unauthorized" and "unknown or revoked token" in err.detail
    assert err.headers is not None and err.headers["www-authenticate"] == "Bearer"
    assert str(err) == f"HTTP 401 Unauthorized: {err.detail}"


def test_another_users_job_is_not_found(api, admin, alice, tmp_path):
    job = alice.client.jobs.create(SPEC)
    bob = admin.users.create("bob")
    with Client(api.url, bob.api_key) as client:
        calls = [client.jobs.get, client.jobs.cancel, client.jobs.prompts, client.jobs.rollouts,
                 client.jobs.metrics, client.checkpoints.versions,
                 lambda i: client.checkpoints.download(i, tmp_path / "x")]
        for call in calls:
            with pytest.raises(NotFoundError) as info:
                call(job.id)
            assert info.value.status == 404 and info.value.detail == f"job {job.id} not found"
    assert alice.client.jobs.get(job.id).status == "queued"  # bob's cancel did nothing
    assert not (tmp_path / "x").exists()


def test_server_422_names_the_field(alice, tmp_path):
    with pytest.raises(BadRequestError) as info:
        alice.client.jobs.create(SPEC, task={"name": "no-such-task"})
    err = info.value
    assert err.status == 422 and [e.field for e in err.errors] == ["task.name"]
    assert "no-such-task" in err.detail
    with pytest.raises(BadRequestError) as info:
        alice.client.jobs.list(limit=0)
    assert info.value.status == 422 and info.value.errors[0].field == "query.limit"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "ok"}) + "\n{oops\n")
    with pytest.raises(BadRequestError) as info:
        alice.client.datasets.upload("bad", bad)
    assert info.value.errors[0].field == "file" and "line 2" in info.value.detail
    assert alice.client.jobs.list().total == 0 and alice.client.datasets.list().total == 0


def test_invalid_spec_is_refused_before_sending(alice):
    with pytest.raises(BadRequestError) as info:
        alice.client.jobs.create(SPEC, staleness=-1, grpo={"group_size": 1})
    err = info.value
    assert err.status is None and {e.field for e in err.errors} == {"staleness", "grpo.group_size"}
    assert "not sent" in str(err)
    with pytest.raises(BadRequestError, match="publish_period"):
        alice.client.jobs.create(SPEC, staleness=0, publish_period=3)
    with pytest.raises(BadRequestError) as info:
        alice.client.datasets.create("empty", [])
    assert info.value.errors[0].field == "items"
    assert alice.client.jobs.list().total == 0


def test_cancel_twice_is_a_conflict(alice):
    job = alice.client.jobs.create(SPEC)
    alice.client.jobs.cancel(job.id)
    with pytest.raises(ConflictError) as info:
        alice.client.jobs.cancel(job.id)
    assert info.value.status == 409 and "already cancelled" in info.value.detail
    assert info.value.retry_after is None


def test_wrong_kind_of_caller_is_permission_denied(alice):
    with pytest.raises(PermissionDeniedError) as info:
        alice.client.users.create("mallory")
    assert info.value.status == 403 and "admin" in info.value.detail
    with pytest.raises(PermissionDeniedError, match="provider token"):
        alice.client.providers.me()


def test_an_upload_over_the_body_limit_goes_in_parts_and_a_body_over_it_is_payload_too_large(api, alice, tmp_path):
    limit = api.server.settings.max_body_bytes
    big = tmp_path / "big.jsonl"
    line = json.dumps({"question": "x" * 1000, "answer": "1"}) + "\n"
    big.write_text(line * (limit // len(line) + 10))
    assert alice.client.datasets.upload("big", big).num_items == limit // len(line) + 10
    with pytest.raises(PayloadTooLargeError) as info:
        alice.client.datasets.create("big", [{"question": "x" * 30_000}] * (limit // 30_000 + 10))
    assert info.value.status == 413 and info.value.errors[0].field == "body"


def test_unreachable_server_is_a_connection_error():
    with Client(f"http://127.0.0.1:{free_port()}", "k", max_retries=1) as client, \
            pytest.raises(ConnectionError) as info:
        client.users.me()
    assert info.value.status is None and "could not reach" in str(info.value)


def test_answers_that_are_not_problem_json(stub):
    with Client(stub.url, "k", max_retries=0) as client:
        stub.reply(Reply(502, b"<html>bad gateway</html>", media_type="text/html"))
        with pytest.raises(ServerError) as info:
            client.users.me()
        assert info.value.status == 502 and "does not look like an Echo2 control plane" in info.value.detail
        assert "<html>" not in str(info.value) and info.value.response.text == "<html>bad gateway</html>"
        stub.reply(Reply(200, b"<html>login portal</html>", media_type="text/html"))
        with pytest.raises(UnexpectedResponseError, match="not a UserRead"):
            client.users.me()
        stub.reply(Reply(418, b'{"detail": "short and stout"}'))
        with pytest.raises(APIStatusError) as teapot:
            client.users.me()
        assert type(teapot.value) is APIStatusError and teapot.value.detail == "short and stout"


def test_an_error_page_from_a_server_that_is_not_echo2_says_so_not_its_html(plain_http):
    with Client(plain_http, "k", max_retries=0) as client, pytest.raises(NotFoundError) as info:
        client.users.me()
    assert str(info.value) == (  # the status line is the file server's own
        f"HTTP 404 File not found: the server at {plain_http} answered GET /v1/me with text/html, not Echo2's "
        "problem+json: it does not look like an Echo2 control plane (check the base URL, ECHO2_BASE_URL or "
        "--base-url, and any proxy in front of the server)")
    assert "<html" in info.value.response.text.lower()  # the page itself is still there to look at


def test_a_base_url_ending_in_v1_is_refused_with_the_url_to_give(api, alice):
    for given in (f"{api.url}/v1", f"{api.url}/v1/"):
        with pytest.raises(ConfigurationError) as info:
            Client(given, alice.key)
        assert str(info.value) == (f"base URL {given!r} ends in /v1: give the server's base URL without it, "
                                   f"{api.url!r} (ECHO2_BASE_URL or --base-url)")
    with Client(api.url, alice.key) as client:  # the URL it names works
        assert client.users.me().id == alice.id


def test_a_file_refused_for_its_bad_lines_names_each_once(alice, tmp_path):
    lines = ['{"prompt": "a"}', "{oops", '{"prompt": "b"}', '{"prompt": "c"}', '["a list"]', '{"prompt": "d"}']
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadRequestError) as info:
        alice.client.datasets.upload("mybad", bad)
    assert str(info.value) == (
        "HTTP 422 Unprocessable Entity: 2 bad lines of 6: line 2: not valid JSON (Expecting property name "
        "enclosed in double quotes: line 1 column 2 (char 1)); line 5: not a JSON object: each line is one item, "
        'like {"prompt": ...}, not a list')
    assert [e.reason.split(":")[0] for e in info.value.errors] == ["line 2", "line 5"]  # still there to act on
    bad.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert alice.client.datasets.upload("mybad", bad).num_items == 2


def test_a_bad_dataset_item_is_named_once(alice):
    answered = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(BadRequestError) as info:  # valid to the SDK's model: the server refuses it
        alice.client.datasets.create("answered", [{"prompt": "a"}, {"messages": answered}])
    assert str(info.value).startswith("HTTP 422 Unprocessable Entity: items.1: 'messages' must end with a user turn")
    assert "item 1" not in str(info.value) and "(also" not in str(info.value)
    dataset = alice.client.datasets.create("no-prompts", [{"question": "q", "reference": "1"}])
    with pytest.raises(BadRequestError) as info:
        alice.client.jobs.create(SPEC, task={"name": "exact_match"}, num_prompts=None, dataset_id=dataset.id)
    assert str(info.value) == ("HTTP 422 Unprocessable Entity: dataset_id: item 0: task 'exact_match': dataset item "
                               "is missing key 'prompt' (keys present: question, reference)")
    assert info.value.errors[0].field == "dataset_id (item 0)"
    with pytest.raises(BadRequestError) as info:  # the same problem in a job's inline prompts
        alice.client.jobs.create(SPEC, num_prompts=None, prompts=[{"item": {"messages": answered}}])
    assert str(info.value) == ("HTTP 422 Unprocessable Entity: prompts.0: 'messages' must end with a user turn (the "
                               "prompt the model answers), not 'assistant'")


def test_fields_with_the_same_reason_are_each_named(alice):
    with pytest.raises(BadRequestError) as info:  # the detail says the first; the others are no less wrong
        alice.client.jobs.create({"task": {"name": "arithmetic"}, "grpo": {"group_size": "a", "prompts_per_step": "b"}})
    assert str(info.value) == (
        "Invalid JobSpec (not sent): name: Field required (also base_model: Field required; grpo.group_size: Input "
        "should be a valid integer, unable to parse string as an integer; grpo.prompts_per_step: Input should be a "
        "valid integer, unable to parse string as an integer)")
