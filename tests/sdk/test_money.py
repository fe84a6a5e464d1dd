"""Money through the SDK (both clients) and the `echo2` command: a job's estimate and ledger, and a
provider's statement as a table, JSON and CSV."""

from __future__ import annotations

import asyncio
import csv
import io
import json

import pytest
from echo2 import AsyncClient, BadRequestError, Client, PermissionDeniedError
from echo2.protocol import JobEstimate, ProviderStatement

from tests.conftest import ADMIN_KEY
from tests.factories import fake_model_folder, new_worker, paid_job

from .conftest import SPEC
from .test_cli import echo2, one_line_error


def admin_provider(api):  # type: ignore[no-untyped-def]
    """A provider signed up by the admin, with its token."""
    with Client(api.url, ADMIN_KEY) as admin:
        return admin.providers.create("sdk-co")


def test_estimate_and_ledger_through_both_clients(api, alice, tmp_path):
    estimate = alice.client.jobs.estimate(SPEC, max_steps=6)
    assert isinstance(estimate, JobEstimate) and estimate.wall_s == pytest.approx(6 * 2.0)
    with pytest.raises(BadRequestError) as refused:
        alice.client.jobs.estimate(SPEC, max_steps=0)
    assert refused.value.status is None and refused.value.errors[0].field == "max_steps"  # checked locally
    created = admin_provider(api)
    job_id, owner = paid_job(api, fake_model_folder(tmp_path / "m"), [new_worker(api, api.client(created.token))])
    key = owner.headers["Authorization"].split()[1]
    with Client(api.url, key) as client:
        ledger = client.jobs.ledger(job_id)
        assert ledger.total_usd > 0 and ledger.total_usd == pytest.approx(client.jobs.get(job_id).cost.total_usd)

    async def main() -> None:
        async with AsyncClient(api.url, key) as client:
            assert (await client.jobs.ledger(job_id, limit=1)).entries == ledger.entries[:1]
            assert (await client.jobs.estimate(SPEC)).t_train_s == pytest.approx(0.1)  # measured on that job
        async with AsyncClient(api.url, created.token) as provider:
            st = await provider.providers.statement()
            assert st.total_usd == pytest.approx(ledger.by_kind[1].amount_usd)
            assert (await provider.providers.statement_csv()).startswith("time,kind,worker,job")

    asyncio.run(main())


def test_a_provider_statement_in_the_sdk_and_the_cli(api, tmp_path):
    created = admin_provider(api)
    paid_job(api, fake_model_folder(tmp_path / "m"), [new_worker(api, api.client(created.token), name)
                                                      for name in ("a", "b")])
    with Client(api.url, created.token) as provider:
        st = provider.providers.statement()
        assert isinstance(st, ProviderStatement) and st.total_entries == 2
        assert provider.providers.statement(since="2999-01-01T00:00:00Z").entries == []
        with pytest.raises(PermissionDeniedError):
            provider.jobs.estimate(SPEC)  # a user's route
    with Client(api.url, ADMIN_KEY) as admin:
        assert admin.providers.statement(created.provider.id) == st
    as_json = echo2("providers", "statement", "--json", url=api.url, key=created.token)
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["total_usd"] == pytest.approx(st.total_usd)
    as_csv = echo2("providers", "statement", "--csv", url=api.url, key=created.token)
    rows = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert [float(r["amount_usd"]) for r in rows] == [e.amount_usd for e in st.entries]
    table = echo2("providers", "statement", url=api.url, key=created.token)
    assert table.returncode == 0 and "trained (job step 1)" in table.stdout
    assert f"total ${st.total_usd:.4f} in the period" in table.stdout
    admin = echo2("providers", "statement", "--provider", created.provider.id, "--json", url=api.url, key=ADMIN_KEY)
    assert json.loads(admin.stdout)["entries"] == json.loads(as_json.stdout)["entries"]
    assert "until must be later than since" in one_line_error(
        echo2("providers", "statement", "--since", "2030-01-02", "--until", "2030-01-01", url=api.url,
              key=created.token))


def test_estimate_and_ledger_commands(api, alice, tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({k: v for k, v in SPEC.items() if k != "name"}))  # named as `jobs submit` names it
    shown = echo2("jobs", "estimate", "--spec", str(spec), "--set", "max_steps=7", url=api.url, key=alice.key)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("estimate $") and "over 14 s" in shown.stdout
    assert "- no worker is available" in shown.stdout
    as_json = json.loads(echo2("jobs", "estimate", "-f", str(spec), "--json", url=api.url, key=alice.key).stdout)
    assert as_json["wall_s"] == pytest.approx(SPEC["max_steps"] * 2.0)
    assert "grpo.group_size" in one_line_error(echo2("jobs", "estimate", "--spec", str(spec), "--set",
                                                     "grpo.group_size=1", url=api.url, key=alice.key))
    job = alice.client.jobs.create(SPEC)
    ledger = echo2("jobs", "ledger", job.id, url=api.url, key=alice.key)
    assert ledger.returncode == 0 and "total $0.0000 (nothing yet); the job's cost $0.0000" in ledger.stdout
