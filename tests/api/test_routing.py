"""The API's route class (api/routing.py) over HTTP: a JSON body validated from its bytes answers exactly as
FastAPI's own parse-then-validate does, for good bodies and every kind of bad one."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from echo2.protocol import RolloutSubmit
from fastapi import APIRouter, FastAPI, Request

from api import errors
from api.routing import ModelBody, make_router
from server.local import free_port


def _echo(body: RolloutSubmit, request: Request) -> dict:
    return {"from_bytes": isinstance(request, ModelBody), "body": body.model_dump(mode="json")}


@pytest.fixture(scope="module")
def both() -> Iterator[str]:
    """One app, the same route under our route class (/ours) and FastAPI's (/plain)."""
    app = FastAPI()
    errors.install(app)
    for prefix, router in (("/ours", make_router()), ("/plain", APIRouter())):
        router.post("/submit")(_echo)
        app.include_router(router, prefix=prefix)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn failed to start"
        threading.Event().wait(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _sample(**change: object) -> dict:
    return {"token_ids": [5, 6], "logprobs": [-0.5, -1.0], "finish_reason": "length", **change}


def _body(*samples: dict, **change: object) -> bytes:
    group = {"prompt_id": 3, "version": 0, "prompt_token_ids": [1, 2], "samples": list(samples) or [_sample()],
             **change}
    return json.dumps({"groups": [group]}).encode()


JSON = {"content-type": "application/json"}
BODIES = {
    "valid": (_body(), JSON),
    "valid, numbers as strings": (_body(version="0", gen_seconds="1.5"), JSON),
    "no content type": (_body(), {}),
    "an unknown field": (_body(surprise=1), JSON),
    "a wrong type": (_body(prompt_id="three"), JSON),
    "logprobs and tokens of unequal length": (_body(_sample(logprobs=[-0.5])), JSON),
    "NaN": (_body().replace(b"-0.5", b"NaN"), JSON),
    "a number too large for a float": (_body().replace(b"-0.5", b"-1e400"), JSON),
    "a lone surrogate": (_body(_sample(text="\udc80")), JSON),  # sent as its JSON escape
    "a NUL in text": (_body(_sample(text="a\x00b")), JSON),
    "truncated JSON": (_body()[:-3], JSON),
    "not UTF-8": ('{"groups": "caf\xe9"}'.encode("latin-1"), JSON),
    "nested past the recursion limit": (b"[" * 100_000 + b"]" * 100_000, JSON),
    "empty": (b"", JSON),
    "JSON null": (b"null", JSON),
    "not JSON content": (_body(), {"content-type": "text/plain"}),
}


@pytest.mark.parametrize("case", list(BODIES))
def test_a_body_validated_from_its_bytes_answers_as_fastapi_does(both, case):
    content, headers = BODIES[case]
    ours = httpx.post(f"{both}/ours/submit", content=content, headers=headers)
    plain = httpx.post(f"{both}/plain/submit", content=content, headers=headers)
    assert (ours.status_code, ours.headers["content-type"]) == (plain.status_code, plain.headers["content-type"])
    if ours.status_code == 200:
        assert ours.json() == {**plain.json(), "from_bytes": True} and not plain.json()["from_bytes"]
    else:
        assert ours.json() == plain.json(), (ours.text, plain.text)
    assert (ours.status_code == 200) == case.startswith("valid")
