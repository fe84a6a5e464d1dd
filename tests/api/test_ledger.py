"""The cost ledger as its readers see it: a provider's statement (JSON and CSV, by period), who may read it,
and a job's ledger, whose entries say what they pay for and sum to the job's cost."""

from __future__ import annotations

import csv
import io
from datetime import timedelta

import pytest

from api.models import utcnow
from tests.factories import fake_model_folder, new_provider, new_user, new_worker, ok, paid_job


def test_a_statement_totals_its_entries_per_worker_and_job_and_matches_earnings(api, tmp_path):
    provider_id, provider = new_provider(api, "mine")
    _, other = new_provider(api, "theirs")
    mine = [new_worker(api, provider, name) for name in ("a", "b")]
    theirs = new_worker(api, other, "c")
    job_id, _ = paid_job(api, fake_model_folder(tmp_path / "m"), [*mine, theirs])
    st = ok(provider.get("/v1/providers/me/statement"))
    assert st["provider_id"] == provider_id and st["total_entries"] == len(st["entries"]) == 2
    assert {e["worker_id"] for e in st["entries"]} == {wid for wid, _ in mine}
    assert all(e["kind"] == "worker" and e["job_id"] == job_id and e["groups"] == 1 for e in st["entries"])
    total = sum(e["amount_usd"] for e in st["entries"])
    assert total > 0
    assert st["total_usd"] == pytest.approx(total) and st["earnings_usd"] == pytest.approx(total)
    assert st["earnings_usd"] == pytest.approx(ok(provider.get("/v1/providers/me"))["earnings_usd"])
    assert {t["key"]: t["amount_usd"] for t in st["by_worker"]} == pytest.approx(
        {e["worker_id"]: e["amount_usd"] for e in st["entries"]})
    assert [(t["key"], t["entries"], t["groups"]) for t in st["by_job"]] == [(job_id, 2, 2)]
    assert st["by_job"][0]["amount_usd"] == pytest.approx(total)
    assert ok(api.admin.get(f"/v1/providers/{provider_id}/statement")) == st


def test_a_statement_as_csv_has_the_same_entries(api, tmp_path):
    _, provider = new_provider(api)
    paid_job(api, fake_model_folder(tmp_path / "m"), [new_worker(api, provider, name) for name in ("a", "b")])
    st = ok(provider.get("/v1/providers/me/statement"))
    for response in (provider.get("/v1/providers/me/statement", params={"format": "csv"}),
                     provider.get("/v1/providers/me/statement", headers={"Accept": "text/csv"})):
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/csv")
        rows = list(csv.DictReader(io.StringIO(response.text)))
        assert list(rows[0]) == ["time", "kind", "worker", "job", "step", "groups", "seconds", "amount_usd", "memo"]
        assert [(r["worker"], r["job"], int(r["step"]), int(r["groups"]), float(r["seconds"]),
                 float(r["amount_usd"]), r["memo"]) for r in rows] == \
            [(e["worker_id"], e["job_id"], e["step"], e["groups"], e["seconds"], e["amount_usd"], e["memo"])
             for e in st["entries"]]
        assert sum(float(r["amount_usd"]) for r in rows) == pytest.approx(st["total_usd"])


def test_a_statement_covers_the_period_asked_for_and_refuses_a_bad_one(api, tmp_path):
    _, provider = new_provider(api)
    paid_job(api, fake_model_folder(tmp_path / "m"), [new_worker(api, provider)])
    later = (utcnow() + timedelta(hours=1)).isoformat()
    assert ok(provider.get("/v1/providers/me/statement", params={"until": later}))["total_entries"] == 1
    empty = ok(provider.get("/v1/providers/me/statement", params={"since": later}))
    assert empty["entries"] == [] and empty["total_usd"] == 0 and empty["by_worker"] == []
    assert empty["earnings_usd"] > 0  # earnings are since sign-up, whatever the period
    naive = (utcnow() + timedelta(hours=1)).replace(tzinfo=None).isoformat()  # taken as UTC
    assert ok(provider.get("/v1/providers/me/statement", params={"since": naive}))["total_entries"] == 0
    for params, field in (({"since": "yesterday"}, "query.since"), ({"format": "xml"}, "query.format"),
                          ({"since": later, "until": later}, "until"), ({"limit": 0}, "query.limit"),
                          ({"since": "0001-01-01T00:00:00+01:00"}, "since")):
        r = provider.get("/v1/providers/me/statement", params=params)
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == field, (params, r.text)


def test_only_the_provider_and_admins_read_its_statement(api, tmp_path):
    provider_id, provider = new_provider(api, "mine")
    _, other = new_provider(api, "theirs")
    _, alice = paid_job(api, fake_model_folder(tmp_path / "m"), [new_worker(api, provider)])
    assert ok(provider.get(f"/v1/providers/{provider_id}/statement"))["total_entries"] == 1
    assert other.get(f"/v1/providers/{provider_id}/statement").status_code == 404
    assert alice.get(f"/v1/providers/{provider_id}/statement").status_code == 403
    assert alice.get("/v1/providers/me/statement").status_code == 403
    assert api.admin.get("/v1/providers/prv_nobody/statement").status_code == 404
    assert ok(other.get("/v1/providers/me/statement"))["entries"] == []


def test_a_job_ledger_says_what_each_entry_pays_for_and_sums_to_the_cost(api, tmp_path):
    _, provider = new_provider(api)
    job_id, alice = paid_job(api, fake_model_folder(tmp_path / "m"), [new_worker(api, provider)])
    ledger = ok(alice.get(f"/v1/jobs/{job_id}/ledger"))
    cost = ok(alice.get(f"/v1/jobs/{job_id}"))["cost"]
    kinds = {t["key"]: t["amount_usd"] for t in ledger["by_kind"]}
    assert kinds == pytest.approx({"learner": cost["learner_usd"], "worker": cost["workers_usd"]})
    assert ledger["total_usd"] == pytest.approx(cost["total_usd"]) == pytest.approx(
        sum(e["amount_usd"] for e in ledger["entries"]))
    assert ledger["cost"] == cost
    worker = next(e for e in ledger["entries"] if e["kind"] == "worker")
    learner = next(e for e in ledger["entries"] if e["kind"] == "learner")
    assert worker["step"] == learner["step"] == 1  # one step trained when they were made
    assert worker["memo"] == "1 group trained (job step 1), 2 s of active time at $3600.00/h"
    assert learner["memo"] == "learner reserved 2.0 s at $1.00/h"
    _, bob = new_user(api, "bob")
    assert bob.get(f"/v1/jobs/{job_id}/ledger").status_code == 404
    page = ok(alice.get(f"/v1/jobs/{job_id}/ledger", params={"limit": 1}))
    assert len(page["entries"]) == 1 and page["next_offset"] == 1 and page["total_usd"] == ledger["total_usd"]
