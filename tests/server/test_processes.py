"""Two API processes on one PostgreSQL serve one fleet: leases, submissions and version notices raced
across them grant nothing twice and lose nothing.

Each process is the operator's own `python -m server.cli api` on its own port (one host, one data
directory: what `echo2-server api --workers 2` runs behind one socket, here addressable one by one so
every race is between the two processes and not inside one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy import select

from api.db import Database
from api.migrate import upgrade
from api.models import Lease, Prompt, Rollout, Worker
from server.local import free_port, wait_port
from tests.conftest import ADMIN_KEY, Api, LiveServer
from tests.factories import (
    activate,
    fake_model_folder,
    new_provider,
    new_user,
    new_worker,
    ok,
    publish,
    running_job,
    step_report,
    submit_group,
)

pytestmark = pytest.mark.postgres_only  # no SQLite twin: several processes are a PostgreSQL deployment
ROOT = Path(__file__).resolve().parents[2]
WORKERS, PROMPTS, PER_LEASE = 8, 240, 5


@pytest.fixture
def database(postgres_url: str) -> Iterator[str]:
    """A database of its own on the tests' PostgreSQL, so the other tests' wipes do not reach it."""
    server = sa.make_url(postgres_url)
    name = f"procs_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    url = server.set(database=name).render_as_string(hide_password=False)
    upgrade(url)  # once, before the processes start: each would otherwise migrate at start
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE {name} WITH (FORCE)"))
        admin.dispose()


@contextmanager
def api_process(url: str, data_dir: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "ECHO2_DATABASE_URL": url, "ECHO2_DATA_DIR": str(data_dir), "ECHO2_PORT": str(port),
           "ECHO2_HOST": "127.0.0.1", "ECHO2_BOOTSTRAP_API_KEY": ADMIN_KEY, "ECHO2_LOG_LEVEL": "WARNING",
           "ECHO2_LEASE_TTL_S": "60", "ECHO2_HEARTBEAT_INTERVAL_S": "1",
           # No learner judges these groups: a worker on probation would stop at a few unjudged ones.
           "ECHO2_PROBATION_AUDITS": "0"}
    log = open(data_dir / f"api-{port}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "api"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        wait_port(port, timeout=120, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def two(database: str, tmp_path: Path) -> Iterator[tuple[Api, Api]]:
    """The two processes, each as the tests' `Api` (an admin client on it; the database for set-up)."""
    data = tmp_path / "data"
    data.mkdir()
    db = Database(database)
    with ExitStack() as stack:
        urls = [stack.enter_context(api_process(database, data)) for _ in range(2)]  # one after the other
        apis = []
        for url in urls:
            admin = stack.enter_context(httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                                                     timeout=60))
            apis.append(Api(server=LiveServer(url=url, settings=None, db=db, app=None), admin=admin))  # type: ignore[arg-type]
        yield apis[0], apis[1]
    db.dispose()


def on(api: Api, client: httpx.Client) -> httpx.Client:
    """The same caller (its token) speaking to the other process."""
    return api.client(client.headers["Authorization"].split()[1])


def _fleet(a: Api, b: Api, tmp_path: Path) -> tuple[dict[str, Any], httpx.Client, list[tuple[str, httpx.Client]]]:
    """A running job of PROMPTS prompts and WORKERS workers, each worker with a client on both processes."""
    _, alice = new_user(a)
    # R = PROMPTS and S = 1: pacing leaves room for every prompt at once
    job, learner = running_job(a, alice, fake_model_folder(tmp_path / "m"), num_prompts=PROMPTS,
                               grpo={"group_size": 2, "prompts_per_step": PROMPTS})
    _, provider = new_provider(b)
    workers = []
    for i in range(WORKERS):
        wid, client = new_worker(b, provider, f"w{i}")
        activate(a, wid, job["id"])
        workers.append((wid, client))
    return job, learner, [(wid, on(a, c)) for wid, c in workers] + [(wid, c) for wid, c in workers]


def test_leases_and_submissions_raced_across_two_processes(two, tmp_path):
    """Every worker leases through both processes at once until the pool is empty, then submits each group
    through both at once: each prompt is leased once and answered by exactly one rollout, each worker's
    accepted groups are numbered once for its audit windows, and no prompt is lost."""
    a, b = two
    job, _, clients = _fleet(a, b, tmp_path)

    def lease_until_empty(client: httpx.Client) -> list[dict[str, Any]]:
        got = []
        while True:
            r = client.post("/v1/leases", json={"job_id": job["id"], "max_prompts": PER_LEASE, "version": 0})
            if r.status_code == 409 and "no prompts available" in r.json()["detail"]:
                return got
            got.append(ok(r, 201))

    with ThreadPoolExecutor(len(clients)) as pool:
        leases = [lease for got in pool.map(lambda wc: lease_until_empty(wc[1]), clients) for lease in got]
    leased = Counter(p["prompt_id"] for lease in leases for p in lease["prompts"])
    assert max(leased.values()) == 1, "a prompt was leased twice"
    assert len(leased) == PROMPTS, "a prompt was lost"

    # The same group through both processes at once, for every leased prompt.
    by_worker = {lease["worker_id"]: [] for lease in leases}
    for lease in leases:
        by_worker[lease["worker_id"]].append(lease)
    twins = {wid: [c for w, c in clients if w == wid] for wid in by_worker}
    tries = [(client, lease, prompt) for wid, mine in by_worker.items() for lease in mine
             for prompt in lease["prompts"] for client in twins[wid]]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda t: submit_group(*t, version=0), tries))
    rollout_of: dict[int, set[str]] = {}
    for (_, _, prompt), r in zip(tries, answers, strict=True):
        result = ok(r)["results"][0]
        assert result["status"] == "accepted", result
        rollout_of.setdefault(prompt["prompt_id"], set()).add(result["rollout_id"])
    assert all(len(ids) == 1 for ids in rollout_of.values()), "a retried group got two answers"

    with a.db.session() as s:
        rows = list(s.execute(select(Rollout.prompt_id, Rollout.worker_id, Rollout.seq)
                              .where(Rollout.job_id == job["id"])))
        states = Counter(s.scalars(select(Prompt.state).where(Prompt.job_id == job["id"])))
        open_leases = s.scalar(select(sa.func.count()).where(Lease.job_id == job["id"], Lease.status == "active"))
    assert sorted(r.prompt_id for r in rows) == sorted(leased), "one rollout per prompt, none lost"
    for wid in by_worker:
        numbers = sorted(r.seq for r in rows if r.worker_id == wid)
        assert numbers == list(range(len(numbers))), f"worker {wid}'s audit numbers repeat or skip"
    assert states["submitted"] == PROMPTS and set(states) <= {"submitted", "eval"}  # eval: held out, never leased
    assert open_leases == 0  # every lease answered in full completed


def test_a_version_published_through_one_process_wakes_waiters_on_the_other(two, tmp_path):
    """Every worker heartbeats through both processes at once (each process group-commits its own batches,
    which name the same workers); then workers long-poll for the next version on process B while the
    learner publishes through A, and a learner claim waiting on B hears of groups accepted through A:
    every heartbeat is answered and recorded, and each waiter gets what happened."""
    a, b = two
    job, learner, clients = _fleet(a, b, tmp_path)
    beats = [(wid, c) for wid, c in clients for _ in range(6)]
    with ThreadPoolExecutor(2 * WORKERS) as pool:
        replies = list(pool.map(lambda wc: ok(wc[1].post(f"/v1/workers/{wc[0]}/heartbeat",
                                                         json={"versions_held": [0]})), beats))
    assert all(r["desired"] == "active" and r["assignment"]["version"] == 0 for r in replies)
    with a.db.session() as s:
        seen = list(s.execute(select(Worker.last_heartbeat_at, Worker.versions_held)
                              .where(Worker.job_id == job["id"])))
    assert len(seen) == WORKERS and all(t is not None and held == [0] for t, held in seen)
    waiters = [c for _, c in clients[WORKERS:]]  # the workers' clients on B
    learner_b = on(b, learner)
    lease = ok(clients[0][1].post("/v1/leases", json={"job_id": job["id"], "max_prompts": 2, "version": 0}), 201)

    def wait_version(client: httpx.Client) -> dict[str, Any]:
        return ok(client.get(f"/v1/jobs/{job['id']}/versions/next", params={"after": 0, "timeout_s": 60}))

    def wait_claim() -> dict[str, Any]:
        return ok(learner_b.post(f"/v1/jobs/{job['id']}/learner/claim",
                                 json={"step": 0, "max_groups": 10, "wait_s": 30}))

    with ThreadPoolExecutor(len(waiters) + 1) as pool:
        claim = pool.submit(wait_claim)
        notices = [pool.submit(wait_version, c) for c in waiters]
        ids = [r["rollout_id"] for r in ok(clients[0][1].post(f"/v1/leases/{lease['id']}/rollouts",
                                                              json={"groups": _groups(lease)}))["results"]]
        batch = claim.result()
        ok(learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(0, ids)))
        publish(learner, job["id"], fake_model_folder(tmp_path / "m1", seed=1), version=1, step=1)
        heard = [n.result() for n in notices]
    assert sorted(g["rollout_id"] for g in batch["groups"]) == sorted(ids)
    assert all(n["changed"] and n["version"] == 1 for n in heard), heard


def _groups(lease: dict[str, Any]) -> list[dict[str, Any]]:
    """One group of two different samples per leased prompt (as tests.factories.submit_group)."""
    samples = [{"token_ids": [5 + k, 6, 7], "logprobs": [-0.5, -1.0, -0.1], "finish_reason": "stop"} for k in range(2)]
    return [{"prompt_id": p["prompt_id"], "version": 0, "prompt_token_ids": [1, 2, 3], "samples": samples}
            for p in lease["prompts"]]


def test_up_runs_several_api_processes_behind_its_port(database, tmp_path):
    """`echo2-server up --api-processes 2` on PostgreSQL: one port, two API processes answering it."""
    port = free_port()
    env = {**os.environ, "ECHO2_DATABASE_URL": database, "ECHO2_DATA_DIR": str(tmp_path / ".echo2"),
           "ECHO2_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "up", "--workers", "0", "--tinker-slots", "0",
                             "--learner-slots", "1", "--api-processes", "2", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        assert any(line.startswith("Echo2 is up") for line in proc.stdout), "up ended before it was up"
        api = int((tmp_path / ".echo2" / "run" / "api.pid").read_text())
        assert len(_served_by(api)) == 2, Path(tmp_path / ".echo2" / "run" / "api.log").read_text()[-2000:]
        key = (tmp_path / ".echo2" / "admin.key").read_text().strip()

        def me(_: int) -> int:  # a connection each, so the kernel hands them to either process
            return httpx.get(f"http://127.0.0.1:{port}/v1/me", headers={"Authorization": f"Bearer {key}"},
                             timeout=30).status_code

        with ThreadPoolExecutor(16) as pool:
            assert Counter(pool.map(me, range(64))) == {200: 64}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def _served_by(pid: int) -> list[int]:
    """The uvicorn worker processes of a supervisor (its other child is multiprocessing's resource tracker)."""
    kids = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
