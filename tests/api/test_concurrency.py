"""Concurrent lease claimers never share a prompt and never lose one (SKIP LOCKED on PostgreSQL,
serialised writers on SQLite)."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.factories import activate, fake_model_folder, new_provider, new_user, new_worker, ok, running_job


@pytest.fixture(autouse=True)
def trusted_workers(api, monkeypatch):  # type: ignore[no-untyped-def]
    """No learner audits here: a worker on probation would stop at 8 groups waiting for their verdict."""
    monkeypatch.setattr(api.server.settings, "probation_audits", 0)


CLAIMERS, PROMPTS = 32, 2000


def test_32_concurrent_claimers_over_2000_prompts(api, tmp_path):
    _, alice = new_user(api)
    # R = 1024 and S = 1: room for (S + 1) R = 2048 groups ahead, so pacing lets all 2000 be leased
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), num_prompts=PROMPTS,
                         grpo={"group_size": 2, "prompts_per_step": 1024})
    _, provider = new_provider(api)
    workers = []
    for i in range(CLAIMERS):
        wid, client = new_worker(api, provider, f"w{i}")
        activate(api, wid, job["id"])
        workers.append(client)

    def claim_until_empty(client):
        got = []
        while True:
            r = client.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 7, "version": 0})
            if r.status_code == 409 and "no prompts available" in r.json()["detail"]:
                return got
            got.extend(p["prompt_id"] for p in ok(r, 201)["prompts"])

    with ThreadPoolExecutor(CLAIMERS) as pool:
        per_worker = list(pool.map(claim_until_empty, workers))
    leased = [pid for ids in per_worker for pid in ids]
    assert len(leased) == len(set(leased)), "a prompt was leased twice"
    assert len(leased) == PROMPTS, "a prompt was lost"
    assert sum(1 for ids in per_worker if ids) > 1


def test_more_callers_than_request_threads_never_deadlock_the_database(api):
    """FastAPI runs each sync dependency and then the route in separate pool threads. A dependency that kept
    its database connection across those hops deadlocked SQLite's single connection once every pool thread
    (40) was waiting for it: requests hung for the pool's 120 s and failed (seen with the Tinker SDK's
    futures polled at once). 120 callers at once, on user and Tinker routes, all answer."""
    _, alice = new_user(api)
    key = alice.headers["Authorization"].split()[1]
    _all_answer(api, [("GET", "/v1/me", {"Authorization": f"Bearer {key}"}, None),
                      ("POST", "/api/v1/client/config", {"X-API-Key": f"tml-{key}"}, {"sdk_version": "0.38.0"})])


def test_a_route_hands_its_connection_back_before_its_answer_is_validated(api):
    """A sync route's answer is validated in another pool thread after the route returns. A read-only route
    (no commit) kept SQLite's one connection across that hop: once every pool thread waited for the
    connection, nobody could validate the answer that would free it (seen with a Tinker learner host
    polling its requests' state beside an async RL loop's futures: the API stalled for the pool's 120 s)."""
    _, alice = new_user(api)
    key = alice.headers["Authorization"].split()[1]
    _all_answer(api, [("GET", "/v1/jobs", {"Authorization": f"Bearer {key}"}, None),
                      ("GET", "/v1/tinker/usage", {"Authorization": f"Bearer {key}"}, None)])


def _all_answer(api, routes: list[tuple[str, str, dict[str, str], dict | None]]) -> None:  # type: ignore[no-untyped-def]
    """360 calls from 120 threads at once, three times as many callers as request threads, taking the
    routes in turn: every one answers 200 (none waits out the pool's timeout)."""

    def call(i: int) -> int:
        method, path, headers, body = routes[i % len(routes)]
        return httpx.request(method, f"{api.url}{path}", headers=headers, json=body, timeout=60).status_code

    with ThreadPoolExecutor(max_workers=120) as pool:
        codes = list(pool.map(call, range(360)))
    assert codes == [200] * 360


def test_groups_one_worker_submits_at_once_get_numbers_of_their_own_and_are_all_counted(api, tmp_path):
    """The audit windows count a worker's groups (api/services/trust.py): submissions racing each other must
    not share numbers, or a worker could send many at once to have them all fall outside its audit. Nor may
    one overwrite another's count of the worker's accepted groups (each once wrote the count it read with the
    worker's token, plus its own)."""
    from sqlalchemy import select

    from api.models import Rollout, Worker
    from tests.factories import submit_group

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), num_prompts=64,
                         grpo={"group_size": 2, "prompts_per_step": 64})
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    leases = [ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}), 201)
              for _ in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda lease: submit_group(worker, lease, lease["prompts"][0], 0), leases))
    assert all(r.status_code == 200 for r in results)
    with api.db.session() as s:
        numbers = list(s.scalars(select(Rollout.seq).where(Rollout.worker_id == wid)))
        counted = s.get(Worker, wid)
    assert sorted(numbers) == list(range(16))
    assert (counted.accepted_rollouts, counted.rejected_rollouts, counted.groups_numbered) == (16, 0, 16)


def test_a_lease_does_not_wait_for_a_transaction_that_added_a_prompt_to_its_job(api, tmp_path):
    """Adding a prompt to a job (a Tinker sample on the fleet job does, holding its model's row) takes a key-share
    lock on the job's row. A lease waiting for that row behind it, and a fleet submission holding its own key share
    of the job while waiting for the model's row, deadlocked on PostgreSQL (bench/load_api.py's tinker phase: 500s).
    Job rows are locked FOR NO KEY UPDATE (api/db.py's WRITER_LOCK), which key shares do not block: the lease is
    granted while the other transaction is still open."""
    from api.models import Prompt, PromptState

    if not api.db.is_postgres:
        pytest.skip("SQLite serialises writers: no row locks")
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), num_prompts=8,
                         grpo={"group_size": 2, "prompts_per_step": 8})
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    with api.db.session() as open_tx:
        open_tx.add(Prompt(job_id=job["id"], index=10**6, text="added, not committed", state=PromptState.available,
                           epoch=0, order_key=10**6))
        open_tx.flush()  # the insert holds its key share of the job's row until this transaction ends
        lease = worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 2, "version": 0}, timeout=10)
        open_tx.rollback()
    assert ok(lease, 201)["prompts"]


def test_forged_groups_sent_at_once_are_a_strike_each(api, tmp_path):
    """Each submission read the worker's strikes with its token, unlocked: eight forged groups sent at once on
    eight leases each wrote strikes = 1 (suspect) where the second should have quarantined the worker, and a
    quarantine racing another submission deadlocked (a 500). A worker's submissions now take turns."""
    import threading

    from api.models import Worker

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"), num_prompts=16,
                         grpo={"group_size": 2, "prompts_per_step": 16, "max_new_tokens": 8})
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    leases = [ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}), 201)
              for _ in range(8)]
    forged = {"token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13], "logprobs": [-1.0] * 9, "finish_reason": "length"}
    gate, answers = threading.Barrier(len(leases)), []

    def send(lease):  # type: ignore[no-untyped-def]
        group = {"prompt_id": lease["prompts"][0]["prompt_id"], "version": 0, "prompt_token_ids": [1, 2, 3],
                 "samples": [forged, forged]}
        with api.client(worker.headers["Authorization"].removeprefix("Bearer ")) as client:
            gate.wait()
            answers.append(client.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))

    threads = [threading.Thread(target=send, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(a.status_code for a in answers) == [200] * 8, [a.text for a in answers if a.status_code != 200]
    assert all(r["status"] == "rejected" for a in answers for r in a.json()["results"])
    with api.db.session() as s:
        w = s.get_one(Worker, wid)
        assert (w.strikes, w.trust) == (8, "quarantined")
