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
    for status in ("offline", "deregistered"):  # the control plane's to set: a worker that said so kept its leases
        bad = _problem(worker.post(f"/v1/workers/{wid}/heartbeat", json={"status": status}), 422)
        assert bad["errors"][0]["field"] == "body.status" and "DELETE /v1/workers/{id}" in bad["errors"][0]["reason"]
    assert ok(api.admin.get(f"/v1/workers/{wid}"))["status"] == "idle"
    _problem(worker.post(f"/v1/workers/{wid}/heartbeat", content=b'{"status": "idle"',
                         headers={"content-type": "application/json"}), 422)
    _problem(worker.post(f"/v1/workers/{wid}/heartbeat", content=b'{"status": "idle"}',
                         headers={"content-type": "text/plain"}), 422)
    _problem(worker.post(f"/v1/workers/{other}/heartbeat", json={}), 403)  # another worker's heartbeat
    _problem(worker.post(f"/v1/workers/{wid}/heartbeat", json={"stats": {"pad": "x" * (17 * 2**20)}}), 413)
    chunks = [b'{"stats": {"pad": "', *[b"x" * 2**20] * 17, b'"}}']  # no length declared: refused as it streams
    _problem(worker.post(f"/v1/workers/{wid}/heartbeat", content=iter(chunks),
                         headers={"content-type": "application/json"}), 413)
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


def test_beats_that_arrive_together_each_write_their_own_row(api):
    """A batch's rows are written together (on PostgreSQL by one statement): each worker's row gets its own
    beat's time, status, stats and versions, and a worker that beat twice in a batch gets one of its beats
    whole, not a mix of the two."""
    from concurrent.futures import ThreadPoolExecutor

    from api.models import Worker

    _, provider = new_provider(api)
    workers = [new_worker(api, provider, f"w{i}") for i in range(12)]
    beats = [(wid, client, {"status": "draining" if i % 2 else "idle", "versions_held": [i, i + 1],
                            "stats": {"rollouts_done": i, "tokens_per_s": 10.5 * i}})
             for i, (wid, client) in enumerate(workers)]
    twice = (workers[0][0], workers[0][1], {"status": "draining", "versions_held": [7], "stats": {"rollouts_done": 99}})
    with ThreadPoolExecutor(len(beats) + 1) as pool:
        answers = list(pool.map(lambda b: b[1].post(f"/v1/workers/{b[0]}/heartbeat", json=b[2]), [*beats, twice]))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    with api.db.session() as s:
        rows = {w.id: w for w in s.query(Worker).filter(Worker.id.in_([wid for wid, _ in workers]))}
    for i, (wid, _, sent) in enumerate(beats):
        row, options = rows[wid], [sent, twice[2]] if i == 0 else [sent]
        assert row.last_heartbeat_at is not None
        assert any((row.status, row.versions_held, row.stats["rollouts_done"]) ==
                   (b["status"], b["versions_held"], b["stats"]["rollouts_done"]) for b in options), (i, row.stats)
        if i > 0:
            assert row.stats["tokens_per_s"] == 10.5 * i and row.version_held is None
