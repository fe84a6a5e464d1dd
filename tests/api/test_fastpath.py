"""The heartbeat's own path (api/fastpath.py) over HTTP: a well-formed beat is answered there, everything else
by the route, so every answer is the one the route documents (these cases pass on the route alone too)."""

from __future__ import annotations

import httpx
from echo2.protocol import HeartbeatReply

from tests.api.test_telemetry import scrape, value
from tests.factories import new_provider, new_worker, ok

ROUTE = "/v1/workers/{worker_id}/heartbeat"


def _problem(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status and r.headers["content-type"] == "application/problem+json", (r.status_code,
                                                                                                   r.text)
    return r.json()


def test_a_well_formed_beat_is_answered_and_counted_under_its_route(api):
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    before = scrape(api)
    beat = worker.post(f"/v1/workers/{wid}/heartbeat", json={"status": "idle", "stats": {}})
    reply = HeartbeatReply.model_validate(ok(beat))
    assert beat.headers["content-type"] == "application/json" and reply.desired == "idle"
    chunked = worker.post(f"/v1/workers/{wid}/heartbeat", headers={"content-type": "application/json"},
                          content=iter([b'{"status": ', b'"idle"}']))  # a body in two parts
    assert {**ok(chunked), "server_time": None} == {**ok(beat), "server_time": None}
    labels = {"method": "POST", "route": ROUTE, "status": "200"}
    assert value(scrape(api), "echo2_http_requests_total", **labels) - _count(before, labels) == 2


def _count(samples: dict, labels: dict[str, str]) -> float:
    return samples.get("echo2_http_requests_total", {}).get(tuple(sorted(labels.items())), 0.0)


def test_what_is_not_a_well_formed_beat_gets_the_routes_own_answer(api):
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    other, _ = new_worker(api, provider, "other")
    token = worker.headers["Authorization"].split()[1]
    url = f"{api.url}/v1/workers/{wid}/heartbeat"
    missing = _problem(httpx.post(url, json={}), 401)
    assert "missing bearer token" in missing["detail"]
    assert httpx.post(url, json={}).headers["www-authenticate"] == "Bearer"
    _problem(httpx.post(url, json={}, headers={"Authorization": f"Basic {token}"}), 401)
    assert ok(httpx.post(url, json={}, headers={"Authorization": f"bearer {token}"}))  # the scheme in any case
    assert ok(httpx.post(url, json={}, headers={"Authorization": f"Bearer  {token}"}))  # as HTTPBearer strips
    bad = _problem(worker.post(f"/v1/workers/{wid}/heartbeat", json={"status": "flying"}), 422)
    assert bad["errors"][0]["field"] == "body.status"
    _problem(worker.post(f"/v1/workers/{wid}/heartbeat", content=b'{"status": "idle"',
                         headers={"content-type": "application/json"}), 422)
    _problem(worker.post(f"/v1/workers/{wid}/heartbeat", content=b'{"status": "idle"}',
                         headers={"content-type": "text/plain"}), 422)
    _problem(worker.post(f"/v1/workers/{other}/heartbeat", json={}), 403)  # another worker's heartbeat
    _problem(worker.post(f"/v1/workers/{wid}/heartbeat", json={"stats": {"pad": "x" * (17 * 2**20)}}), 413)
    _problem(httpx.post(url, json={}, headers={"Authorization": "Bearer e2w_not-a-token"}), 401)


def test_a_batch_of_beats_reads_its_tokens_in_one_query(api):
    """Workers of a large fleet beat less often than the identity cache keeps them: the beats that arrive
    together are authenticated by one token query, not one each."""
    from concurrent.futures import ThreadPoolExecutor

    from sqlalchemy import event

    from api import auth

    _, provider = new_provider(api)
    workers = [new_worker(api, provider, f"w{i}") for i in range(24)]
    auth.forget_all()
    statements: list[str] = []
    listener = lambda conn, cursor, statement, *rest: statements.append(statement)  # noqa: E731
    event.listen(api.db.engine, "before_cursor_execute", listener)
    try:
        with ThreadPoolExecutor(len(workers)) as pool:
            beats = list(pool.map(lambda w: w[1].post(f"/v1/workers/{w[0]}/heartbeat", json={}), workers))
    finally:
        event.remove(api.db.engine, "before_cursor_execute", listener)
    assert all(b.status_code == 200 for b in beats)
    batches = sum(1 for s in statements if s.lstrip().upper().startswith("SELECT") and "FROM workers" in s
                  and "workers.audit_salt" in s)  # one worker read per batch (heartbeats._authenticate)
    token_reads = sum(1 for s in statements if "FROM tokens" in s)
    assert 1 <= token_reads == batches < len(workers), (token_reads, batches)
