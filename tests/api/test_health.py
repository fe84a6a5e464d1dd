from tests.factories import new_provider, new_user, ok


def test_health_and_readiness(api):
    assert ok(api.client().get("/healthz")) == {"status": "ok"}
    assert ok(api.client().get("/readyz")) == {"status": "ready"}


def test_prometheus_metrics_report_fleet_and_requests(api):
    api.admin.get("/v1/me")
    assert api.client().get("/metrics").status_code == 401  # its series name every tenant's jobs and workers
    _, alice = new_user(api)
    _, provider = new_provider(api)
    assert alice.get("/metrics").status_code == provider.get("/metrics").status_code == 403
    text = api.admin.get("/metrics").text
    assert "echo2_http_requests_total" in text
    assert 'route="/v1/me"' in text
    assert "echo2_jobs" in text


def test_openapi_has_stable_operation_ids_and_descriptions(api):
    spec = ok(api.client().get("/openapi.json"))
    ops = [op for path in spec["paths"].values() for op in path.values()]
    ids = [op["operationId"] for op in ops]
    assert len(ids) == len(set(ids))
    assert all(op.get("summary") for op in ops)
    assert {"create_job", "create_lease", "submit_rollouts", "learner_claim", "worker_heartbeat"} <= set(ids)


def test_oversized_body_is_413(api):
    big = "x" * (api.server.settings.max_body_bytes + 10)
    r = api.admin.post("/v1/users", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["errors"][0]["field"] == "body"


def test_malformed_json_is_422_not_500(api):
    r = api.admin.post("/v1/users", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422
