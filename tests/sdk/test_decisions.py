"""`jobs.decisions` (Client and AsyncClient) and `echo2 jobs explain`, on decisions made by real scheduler ticks."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from echo2 import AsyncClient, BadRequestError, Client, NotFoundError
from echo2.protocol import DecisionRead

from scheduler.reconcile import tick
from tests.conftest import Api
from tests.factories import fake_model_folder, new_provider, new_worker, ok, running_job

from .conftest import User
from .test_cli import echo2, one_line_error


def reconcile(api: Api) -> None:
    """One reconcile tick on the live control plane's database, as the scheduler process runs it."""
    with api.db.session() as session:
        tick(session, api.server.settings, lambda job, token, placement: None)


@dataclass
class Explained:
    job_id: str
    cheap: set[str]  # activated by the first tick
    pricey: str  # left idle: the job's decisions say why
    joined: str  # joined before the second tick


@pytest.fixture
def explained(api: Api, alice: User, tmp_path: Path) -> Explained:
    """Two ticks: the first activates the cheapest sufficient workers (four: unmeasured, each counts for at
    most a quarter of the need), the second (a worker joined) keeps them."""
    job, learner = running_job(api, api.client(alice.key), fake_model_folder(tmp_path / "model"),
                               grpo={"group_size": 2, "prompts_per_step": 2})
    learner.close()
    _, provider = new_provider(api)
    ids = {}
    for name, price in (*((f"cheap{i}", 0.1) for i in range(4)), ("pricey", 9.0)):
        wid, worker = new_worker(api, provider, name, price_per_hour=price, rollouts_per_s=100.0)
        ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={}))
        ids[name] = wid
    reconcile(api)
    joined, worker = new_worker(api, provider, "late", price_per_hour=0.05, rollouts_per_s=100.0)
    ok(worker.post(f"/v1/workers/{joined}/heartbeat", json={}))
    reconcile(api)
    return Explained(job["id"], {ids[f"cheap{i}"] for i in range(4)}, ids["pricey"], joined)


def check_decisions(decisions: list[DecisionRead], ex: Explained) -> None:
    assert decisions and all(isinstance(d, DecisionRead) for d in decisions)
    assert [d.created_at for d in decisions] == sorted((d.created_at for d in decisions), reverse=True)
    first = decisions[-1]  # oldest: the first tick's activation
    assert first.worker_id in ex.cheap and (first.action, first.trigger) == ("activated", "first decision")
    assert first.line.startswith(f"activated {first.worker_id}: ")
    newest = decisions[0]
    assert newest.trigger == f"churn: {ex.joined} joined" and newest.line.startswith(f"{newest.action} ")
    pricey = [d for d in decisions if d.worker_id == ex.pricey]  # never picked, but explained on this job
    assert pricey and all(d.action == "idle" and "qualifies but not needed" in d.line for d in pricey)
    assert all(d.line and d.action in {"activated", "kept", "deactivated", "idle", "skipped"} for d in decisions)


def test_client_decisions(api, admin, alice, explained):
    decisions = alice.client.jobs.decisions(explained.job_id)
    check_decisions(decisions, explained)
    raw = ok(api.client(alice.key).get(f"/v1/jobs/{explained.job_id}/decisions"))
    assert [d.model_dump(mode="json") for d in decisions] == [DecisionRead.model_validate(r).model_dump(mode="json")
                                                             for r in raw]
    assert alice.client.jobs.decisions(explained.job_id, limit=1) == decisions[:1]
    assert admin.jobs.decisions(explained.job_id) == decisions  # admins see every job
    with pytest.raises(BadRequestError) as bad:
        alice.client.jobs.decisions(explained.job_id, limit=0)
    assert bad.value.status == 422
    with pytest.raises(NotFoundError):
        alice.client.jobs.decisions("job_missing")
    with Client(api.url, admin.users.create("bob").api_key) as bob, pytest.raises(NotFoundError):
        bob.jobs.decisions(explained.job_id)  # another user's job does not exist for bob
    fresh = alice.client.jobs.create(name="untouched", base_model="echo2:tiny", task="arithmetic")
    assert alice.client.jobs.decisions(fresh.id) == []


def test_async_client_decisions(api, alice, explained):
    async def main() -> None:
        async with AsyncClient(api.url, alice.key) as client:
            decisions = await client.jobs.decisions(explained.job_id)
            check_decisions(decisions, explained)
            assert await client.jobs.decisions(explained.job_id, limit=1) == decisions[:1]
            with pytest.raises(NotFoundError):
                await client.jobs.decisions("job_missing")
            with pytest.raises(BadRequestError):
                await client.jobs.decisions(explained.job_id, limit=201)

    asyncio.run(main())


def test_cli_jobs_explain(api, alice, explained):
    url, key, jid = api.url, alice.key, explained.job_id
    decisions = alice.client.jobs.decisions(jid)

    human = echo2("jobs", "explain", jid, url=url, key=key)
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    history_at = lines.index('history, newest first (a worker\'s repeated "kept" lines folded):')
    assert lines[0] == "why each worker is where it is (its newest reason):"
    newest: dict[str, DecisionRead] = {}
    for d in decisions:
        if d.action != "kept":
            newest.setdefault(d.worker_id, d)
    assert [parse(line)[1:] for line in lines[1:history_at]] == [(d.action, d.line) for d in newest.values()]
    assert {w for w, d in newest.items() if d.action == "activated"} >= explained.cheap
    history = [parse(line) for line in lines[history_at + 1:]]
    assert history[-1][1:] == (decisions[-1].action, decisions[-1].line)  # the first tick's activation, last

    one = echo2("jobs", "explain", jid, "--limit", "1", url=url, key=key)
    assert one.returncode == 0 and parse(one.stdout.splitlines()[-1])[2] == decisions[0].line

    as_json = echo2("jobs", "explain", jid, "--json", url=url, key=key)
    assert as_json.returncode == 0, as_json.stderr
    body = json.loads(as_json.stdout)
    parsed = [DecisionRead.model_validate(d) for d in body["decisions"]]
    assert parsed == decisions and all("trigger" in d for d in body["decisions"]) and body["failed_audits"] == []

    assert "not found" in one_line_error(echo2("jobs", "explain", "job_missing", url=url, key=key)).lower()
    bad = echo2("jobs", "explain", jid, "--limit", "0", url=url, key=key)
    assert bad.returncode == 1 and "limit" in one_line_error(bad)
    assert echo2("jobs", "explain", jid, "--limit", "x", url=url, key=key).returncode == 2
    fresh = alice.client.jobs.create(name="untouched", base_model="echo2:tiny", task="arithmetic")
    empty = echo2("jobs", "explain", fresh.id, url=url, key=key)
    assert empty.returncode == 0 and empty.stdout.strip() == "(no activation decisions yet)"
    assert json.loads(echo2("jobs", "explain", fresh.id, "--json", url=url, key=key).stdout) == {
        "decisions": [], "failed_audits": []}
    assert "explain" in echo2("jobs", "--help").stdout


def parse(line: str) -> tuple[str, str, str]:
    m = re.fullmatch(r"  (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)  (\w+) *  (\S.*?)(?:  \(x\d+ since [\d:]+\))?", line)
    assert m, line
    return m.group(1), m.group(2), m.group(3)


def test_explain_puts_the_activation_reasons_first_and_folds_repeated_kept_lines(api, alice, explained):
    _, provider = new_provider(api, "more")
    for i in range(6):  # each tick re-solves (a worker joined) and keeps the job's workers: "kept" lines pile up
        wid, worker = new_worker(api, provider, f"more{i}", price_per_hour=5.0, rollouts_per_s=100.0)
        ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={}))
        reconcile(api)
    decisions = alice.client.jobs.decisions(explained.job_id, limit=200)
    human = echo2("jobs", "explain", explained.job_id, "--limit", "200", url=api.url, key=alice.key)
    lines = human.stdout.splitlines()
    history_at = next(i for i, line in enumerate(lines) if line.startswith("history"))
    now = [parse(line) for line in lines[1:history_at]]
    for worker in explained.cheap:  # its activation is among the first lines, not below its "kept" ones
        assert any(line.startswith(f"activated {worker}: ") for _, _, line in now), now
    kept = [d for d in decisions if d.action == "kept" and d.worker_id in explained.cheap]
    # stored as changes: one row per worker's run of "kept", counting the re-solves it stands for
    assert len(kept) == len(explained.cheap) and sum(d.repeats for d in kept) >= 4 * 6
    assert all(d.decided_at > d.created_at for d in kept)
    folded = [line for line in lines[history_at + 1:] if " kept " in line]
    assert len(folded) == len(explained.cheap) and all("(x" in line for line in folded)
