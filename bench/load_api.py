"""Control-plane load: the worker-facing hot endpoints against ONE real uvicorn process (or N with
`--api-processes N`, one PostgreSQL behind them; their CPU is summed), and the learner's and Tinker's
routes that ride on them.

    python bench/load_api.py --db both --duration 10

For each database (SQLite file, PostgreSQL private cluster on loopback) this starts the real API as
a subprocess (`python -m server.cli api`), registers a fleet of workers through the API, creates a
running job with a published version 0, activates every worker on it (what the scheduler does),
then runs bounded phases, each a closed loop of `--concurrency` in-flight requests except `paced`:

1. heartbeat  `POST /v1/workers/{id}/heartbeat`, every worker with its own token (the most the
              server sustains with that many in flight);
   paced      the same heartbeats offered open-loop at `--heartbeat-rate` per second (a fleet of
              rate x 2 s workers heartbeating every 2 s; the registered workers take turns), with at
              most `--concurrency` connections, each latency measured from its scheduled send time, so a
              server that falls behind shows it in the tail instead of slowing the generator down;
2. lease      `POST /v1/leases` (`--lease-prompts` prompts each); afterwards the leases are released
              in the database (not timed) so phase 3 starts from a full pool;
3. rollouts   the worker loop: lease, then `POST /v1/leases/{id}/rollouts` with batches of groups
              of G samples of `--tokens` tokens. A *group* is one prompt's G samples; a *sample* is
              one completion. Both rates are reported, counting accepted groups only;
4. audits     the learner: `POST /v1/jobs/{id}/learner/claim` of `--claim-groups` groups for step 0,
              then `POST .../learner/audits` with a passed verdict on each group the claim picked for an
              audit (api/services/trust.py::should_audit: one in round(1 / audit_rate) of a trusted
              worker's groups). Before it the job's queue is topped up to `--audit-queue` groups
              through the workers' lease and rollouts routes (not timed). The learner's claims and
              verdicts lock the job's row, so on PostgreSQL its requests in flight take turns;
5. episodes   the multi-turn worker loop on a job of its own (`guess_number`, the tiny model's
              tokenizer): lease, `POST /v1/leases/{id}/episodes` once a turn with one step per episode
              (G per leased prompt) until every episode is over, then submit the groups;
6. tinker     Tinker fleet sampling on a job of its own: a Tinker user's `POST /api/v1/asample` (G
              samples) on a LoRA model's sampler checkpoint, which becomes a prompt of the model's fleet
              job; a worker on that job leases it and answers it with its group.

The load generator is `--clients` separate processes, each a uvloop event loop with one aiohttp
session (keep-alive pool; about a third of httpx's client CPU per request, which matters when the
generator shares the machine with the server). On a small box it competes with the server for CPU, so each
phase also reports the CPU cores used by the server, the database, the load generator and anything
else running on the machine, read from /proc while the phase runs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import date
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ADMIN_KEY = "e2u_bench-admin-key-0123456789abcdef0123456789"
PROMPT_IDS = json.dumps(list(range(100, 132)))  # the main job's groups' prompt tokens
VOCAB = 151_000  # the main job's sample token ids are drawn below this (a Qwen-sized vocabulary)
PHASES = ("heartbeat", "paced", "lease", "rollouts", "audits", "episodes", "tinker")


# ---------------------------------------------------------------- setup: server, fleet, job


@contextmanager
def api_server(db_url: str, data_dir: Path, lease_ttl_s: float, processes: int = 1):  # type: ignore[no-untyped-def]
    """`python -m server.cli api --workers N` as a subprocess (it migrates, then runs N uvicorn processes)."""
    from server.local import free_port, wait_port

    port = free_port()
    env = {**os.environ, "ECHO2_DATABASE_URL": db_url, "ECHO2_DATA_DIR": str(data_dir),
           "ECHO2_PORT": str(port), "ECHO2_HOST": "127.0.0.1", "ECHO2_BOOTSTRAP_API_KEY": ADMIN_KEY,
           "ECHO2_LOG_LEVEL": "WARNING", "ECHO2_LEASE_TTL_S": str(lease_ttl_s),
           # A fleet in its steady state: trusted workers (no learner judges the bench's groups, and one on
           # probation may hold only a few unjudged groups at once).
           "ECHO2_PROBATION_AUDITS": "0"}
    log = open(data_dir / "server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "api", "--workers", str(processes)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_port(port, timeout=120, proc=proc)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@dataclass
class Fleet:
    """What a phase drives: a job, the workers on it, and what its other side needs."""

    job_id: str
    workers: list[tuple[str, str]]  # (worker id, token)
    token: str = ""  # the job's learner token (audits), or the Tinker user's API key (tinker)
    sampler: str = ""  # tinker: the sampling session the user's requests name
    actions: list[list[int]] = field(default_factory=list)  # episodes: model turns to play, as token ids


def _ok(response: Any, status: int = 200) -> Any:
    if response.status_code != status:
        raise RuntimeError(f"{response.request.method} {response.request.url.path}: "
                           f"{response.status_code} {response.text[:500]}")
    return response.json() if response.content else None


def _fake_model(root: Path, seed: int = 0) -> Path:
    """A small folder shaped like an HF model (one safetensors file + config), as in the API tests."""
    import numpy as np
    from safetensors.numpy import save_file

    root.mkdir(parents=True, exist_ok=True)
    weights = np.random.default_rng(seed).standard_normal((64, 512)).astype("float32")
    save_file({"w": weights}, str(root / "model.safetensors"))
    (root / "config.json").write_text('{"model_type": "test"}')
    return root


def _publish(base_url: str, token: str, job_id: str, folders: list[Path], *, start: bool = True) -> None:
    """Publish versions 0, 1, ... from `folders` as the learner does (learner.remote: its weight sink), after
    starting the job's learner (a Tinker fleet job has none: its learner host only publishes)."""
    from echo2.snapshots import build_manifest

    from learner.remote import ControlPlane

    plane = ControlPlane(base_url, token, job_id)
    try:
        if start:
            plane.start()
        for version, folder in enumerate(folders):
            plane.publish([(folder, build_manifest(folder, version, version, 64 * 1024))])
    finally:
        plane.close()


def _client(base_url: str, token: str) -> Any:
    import httpx

    return httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=300)


@contextmanager
def _accounts(base_url: str, name: str):  # type: ignore[no-untyped-def]
    """Clients of the admin and of a new user and provider, each job's own."""
    with ExitStack() as stack:
        admin = stack.enter_context(_client(base_url, ADMIN_KEY))
        user = _ok(admin.post("/v1/users", json={"name": name, "role": "user"}), 201)["api_key"]
        provider = _ok(admin.post("/v1/providers", json={"name": f"{name}-gpus"}), 201)["token"]
        yield admin, stack.enter_context(_client(base_url, user)), stack.enter_context(_client(base_url, provider))


def _register(provider: Any, args: argparse.Namespace) -> list[tuple[str, str]]:
    workers = []
    for i in range(args.workers):
        relays = args.relay_every and i % args.relay_every == 0
        relay = {"relay_url": f"http://127.0.0.1:9/w{i}"} if relays else {}
        fields = {"name": f"w{i}", "gpu_model": "H100", "gpu_count": 1, "vram_gb": 80, "upload_mbps": 100 + i}
        body = _ok(provider.post("/v1/workers", json={**fields, **relay}), 201)
        workers.append((body["worker"]["id"], body["token"]))
    return workers


def _staff(db_url: str, job_id: str, workers: list[tuple[str, str]], versions: list[int]) -> None:
    """Activate the workers on the job, which the scheduler does in the database."""
    from api.db import Database
    from api.models import Job, Worker
    from api.services.fleet import assign
    from api.settings import get_settings

    db = Database(db_url)
    with db.session() as s:
        job = s.get(Job, job_id)
        for worker_id, _ in workers:
            worker = s.get(Worker, worker_id)
            assign(s, worker, job, get_settings())  # type: ignore[arg-type]
            # and it fetched the versions (a lease is granted only at a version the worker reported holding,
            # which the heartbeat phase would report; the other phases may run without it)
            worker.versions_held = versions  # type: ignore[union-attr]
        s.commit()
    db.dispose()


def _job_fleet(base_url: str, db_url: str, name: str, spec: dict[str, Any], folder: Path,
               args: argparse.Namespace) -> Fleet:
    """A running job of a new user with version 0 published from `folder`, and new workers activated on it."""
    with _accounts(base_url, name) as (admin, user, provider):
        workers = _register(provider, args)
        job_id = _ok(user.post("/v1/jobs", json=spec), 201)["id"]
        learner_token = _ok(admin.post(f"/v1/jobs/{job_id}/learner/token"), 201)["token"]
        _publish(base_url, learner_token, job_id, [folder])
    _staff(db_url, job_id, workers, [0])
    return Fleet(job_id=job_id, workers=workers, token=learner_token)


def _grpo(args: argparse.Namespace, **fields: Any) -> dict[str, Any]:
    # No learner trains here, so paced leasing must not be what limits the lease phases: R and S at their
    # maxima give a job room for (S + 1) R = 66,560 groups in flight.
    return {"grpo": {"group_size": args.group_size, "prompts_per_step": 1024, **fields}, "staleness": 64,
            "num_prompts": args.prompts, "max_steps": 1000}


def build_fleet(base_url: str, db_url: str, work: Path, args: argparse.Namespace) -> Fleet:
    """The main job (`arithmetic`) and its workers, everything through the API except activation."""
    spec = {"name": "bench", "base_model": "echo2:tiny", "task": {"name": "arithmetic"}, **_grpo(args),
            "partial_rollouts": args.partial}
    return _job_fleet(base_url, db_url, "bench", spec, _fake_model(work / "model"), args)


GUESS = {"name": "guess_number", "params": {"low": 100_000, "high": 999_999, "max_turns": 3}}  # as tests/api
TINKER_HOST = "bench-host"
TINKER_PROMPT = list(range(32, 64))  # token ids of the tiny model's vocabulary


def episode_fleet(base_url: str, db_url: str, work: Path, args: argparse.Namespace) -> Fleet:
    """A multi-turn job on the tiny model (its tokenizer decodes the turns and encodes the replies), its
    workers, and guesses to play as the tiny model's tokens, each ended by its eos (id 0)."""
    from tokenizers import Tokenizer

    from learner.tiny import build_tiny_model

    folder = build_tiny_model(work / "tiny", seed=0)
    spec = {"name": "bench-episodes", "base_model": "echo2:tiny", "task": GUESS, **_grpo(args, max_new_tokens=16)}
    fleet = _job_fleet(base_url, db_url, "bench-episodes", spec, folder, args)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    fleet.actions = [[*tokenizer.encode(f"{guess}.").ids, 0] for guess in range(100_003, 999_999, 28_657)]
    return fleet


def _host_work(admin: Any, holding: list[str]) -> dict[str, Any]:
    """The bench as the Tinker learner host (admin routes, as tests/tinker do): its next request."""
    body = {"host": TINKER_HOST, "slots": 1, "wait_s": 0, "holding": holding, "price_per_hour": 0.0}
    return _ok(admin.post("/v1/tinker/host/claim", json=body))["work"]


def _host_result(admin: Any, work: dict[str, Any], **result: Any) -> None:
    _ok(admin.post(f"/v1/tinker/host/requests/{work['request_id']}/result", params={"host": TINKER_HOST},
                   json=result))


def _tinker_model(admin: Any, user: Any) -> str:
    """A Tinker session's LoRA training model on the tiny model, loaded by the host."""
    from echo2.models import TINY_VOCAB_SIZE

    session = _ok(user.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}))["session_id"]
    created = _ok(user.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                           "base_model": "echo2:tiny", "lora_config": {"rank": 4}}))
    info = {"tokenizer_id": "echo2:tiny", "arch": "qwen2", "vocab_size": TINY_VOCAB_SIZE, "max_context_length": 512}
    _host_result(admin, _host_work(admin, []), info=info)  # what the host learnt loading it
    return created["model_id"]


def _sampler_checkpoint(base_url: str, work: Path, admin: Any, user: Any) -> tuple[str, str]:
    """The model's first sampler checkpoint, version 1 of its fleet job (version 0: the base), published by the
    host: (the fleet job, the user's sampling session on the checkpoint)."""
    model_id = _tinker_model(admin, user)
    saved = _ok(user.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id,
                                                                    "sampling_session_seq_id": 1}))
    save = _host_work(admin, [model_id])
    order = save["publish"]
    _publish(base_url, order["token"], order["job_id"], [_fake_model(work / f"tinker-v{v}", seed=v) for v in (0, 1)],
             start=False)
    _host_result(admin, save, step=1, published=1)
    future = _ok(user.post("/api/v1/retrieve_future", json={"request_id": saved["request_id"]}))
    return order["job_id"], future["sampling_session_id"]


def tinker_fleet(base_url: str, db_url: str, work: Path, args: argparse.Namespace) -> Fleet:
    """A Tinker user's sampler checkpoint on its fleet job, served by new workers at work on it (their
    heartbeats say so: the user's requests go to the fleet only while a worker serves the job)."""
    with _accounts(base_url, "bench-tinker") as (admin, user, provider):
        job_id, sampler = _sampler_checkpoint(base_url, work, admin, user)
        workers = _register(provider, args)
        _staff(db_url, job_id, workers, [0, 1])
        beat = {"status": "active", "job_id": job_id, "versions_held": [0, 1]}
        for worker_id, token in workers:
            with _client(base_url, token) as worker:
                _ok(worker.post(f"/v1/workers/{worker_id}/heartbeat", json=beat))
        key = user.headers["Authorization"].removeprefix("Bearer ")
    return Fleet(job_id=job_id, workers=workers, token=key, sampler=sampler)


def fill_queue(base_url: str, fleet: Fleet, args: argparse.Namespace) -> int:
    """Before the audits phase: the main job's queue topped up to --audit-queue groups by the workers' own
    lease and rollouts requests (not timed), so that the learner's claims do not run dry in the phase."""
    with _client(base_url, ADMIN_KEY) as admin:
        queued = _ok(admin.get(f"/v1/jobs/{fleet.job_id}/rollouts", params={"status": "accepted", "limit": 1}))
    # 2,000 a second: over three times what the claims took on 2 cores (about 600 groups a second, shared).
    want = (args.audit_queue or int(2000 * (args.warmup + args.duration))) - queued["total"]
    if want <= 0:
        return 0
    spec = _client_spec("rollouts", base_url, fleet, fleet.workers, args.concurrency["rollouts"], time.monotonic(),
                        0, args)
    spec.warmup_s, spec.duration_s = 0.0, math.inf
    return asyncio.run(_fill(spec, want))


def phase_fleet(phase: str, fleet: Fleet, base_url: str, db_url: str, work: Path, args: argparse.Namespace) -> Fleet:
    """What the phase drives: the main job's fleet, or a job of its own, set up just before it (not timed)."""
    t0 = time.monotonic()
    if phase == "audits":
        _say(f"[{args.db_now}] queued {fill_queue(base_url, fleet, args)} more groups for the learner to claim "
             f"in {time.monotonic() - t0:.1f}s")
    setup = {"episodes": episode_fleet, "tinker": tinker_fleet}.get(phase)
    if setup is None:
        return fleet
    own = setup(base_url, db_url, work, args)
    _say(f"[{args.db_now}] {phase}: job {own.job_id} and {len(own.workers)} workers of its own ready in "
         f"{time.monotonic() - t0:.1f}s")
    return own


def rollout_storage(db_url: str, group_size: int) -> dict[str, Any]:
    """What the stored rollouts take in the database: the table with its indexes and (PostgreSQL) TOAST."""
    from sqlalchemy import text

    from api.db import Database

    db = Database(db_url)
    size = ("SELECT pg_total_relation_size('rollouts')" if db.is_postgres else
            "SELECT SUM(pgsize) FROM dbstat WHERE name IN (SELECT name FROM sqlite_master WHERE tbl_name = 'rollouts')")
    with db.engine.connect() as conn:
        groups = conn.execute(text("SELECT COUNT(*) FROM rollouts")).scalar_one()
        nbytes = int(conn.execute(text(size)).scalar_one() or 0)
    db.dispose()
    samples = groups * group_size
    return {"groups": groups, "bytes": nbytes, "bytes_per_sample": nbytes / samples if samples else None,
            "gb_per_million_samples": nbytes / samples * 1e6 / 1e9 if samples else None}


def release_leases(db_url: str, job_id: str) -> int:
    """Between phases: give every active lease back so the next phase sees a full pool."""
    from sqlalchemy import select

    from api.db import Database
    from api.models import Lease
    from api.services.pool import end_lease

    db = Database(db_url)
    with db.session() as s:
        leases = list(s.scalars(select(Lease).where(Lease.job_id == job_id, Lease.status == "active")))
        for lease in leases:
            end_lease(s, lease, "released")
        s.commit()
    db.dispose()
    return len(leases)


# ---------------------------------------------------------------- load generator (client processes)


@dataclass
class ClientSpec:
    phase: str
    base_url: str
    job_id: str
    workers: list[tuple[str, str]]
    concurrency: int
    start_at: float  # time.monotonic(), which is system-wide on Linux
    warmup_s: float
    duration_s: float
    lease_prompts: int
    groups_per_request: int
    group_size: int
    tokens: int
    seed: int
    rate: float = 0.0  # paced phase: heartbeats per second this client offers
    partial: bool = False  # samples carry per-token versions, as partial rollouts send them
    claim_groups: int = 16  # audits: groups per learner claim
    token: str = ""  # Fleet.token: the learner's (audits) or the Tinker user's (tinker)
    sampler: str = ""  # Fleet.sampler
    actions: list[list[int]] = field(default_factory=list)  # Fleet.actions


@dataclass
class Record:
    """What one client process saw inside the measurement window."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: dict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    errors: Counter[str] = field(default_factory=Counter)
    groups: int = 0  # accepted (audits: claimed)
    rejected_groups: int = 0
    audits: int = 0  # verdicts recorded
    steps: int = 0  # episode steps answered
    cpu_s: float = 0.0


class Window:
    def __init__(self, spec: ClientSpec) -> None:
        self.begin = spec.start_at + spec.warmup_s
        self.end = self.begin + spec.duration_s

    def __contains__(self, t: float) -> bool:
        return self.begin <= t <= self.end


def client_main(spec: ClientSpec) -> Record:
    import uvloop

    return uvloop.run(_drive(spec))


@dataclass
class Reply:
    status_code: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Poster:
    """POST over one aiohttp session: the little the phases need from a client."""

    def __init__(self, session: Any, base_url: str) -> None:
        self.session, self.base_url = session, base_url

    async def post(self, path: str, content: bytes, headers: dict[str, str]) -> Reply:
        async with self.session.post(self.base_url + path, data=content, headers=headers) as r:
            return Reply(r.status, await r.read())


@asynccontextmanager
async def _poster(spec: ClientSpec):  # type: ignore[no-untyped-def]
    import aiohttp

    connector = aiohttp.TCPConnector(limit=spec.concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield Poster(session, spec.base_url)


async def _drive(spec: ClientSpec) -> Record:
    rec, window = Record(), Window(spec)
    async with _poster(spec) as client:
        await asyncio.sleep(max(0.0, spec.start_at - time.monotonic()))
        if spec.phase == "paced":
            await asyncio.gather(_cpu_in_window(rec, window), _heartbeat_paced(client, spec, rec, window))
            return rec
        loop = {"heartbeat": _heartbeat_loop, "lease": _lease_loop, "rollouts": _rollout_loop,
                "audits": _audit_loop, "episodes": _episode_loop, "tinker": _tinker_loop}[spec.phase]
        # Each coroutine owns a disjoint slice of the workers, as each real worker runs one loop.
        await asyncio.gather(_cpu_in_window(rec, window),
                             *(loop(client, spec, spec.workers[k::spec.concurrency], rec, window)
                               for k in range(spec.concurrency)))
    return rec


async def _fill(spec: ClientSpec, groups: int) -> int:
    """Rounds of the rollouts loop, in this process, until `groups` more groups are accepted or no more
    can be leased."""
    rec, window = Record(), Window(spec)
    samples, lease_body = _sample_pool(spec, VOCAB, spec.partial), _lease_body(spec)

    async def worker(client: Poster, token: str) -> None:
        while rec.groups < groups:
            if not await _lease_and_submit(client, spec, rec, window, token, samples, lease_body):
                return  # no prompt left, or no room in the job's staleness bound: the queue is as full as it gets

    async with _poster(spec) as client:
        await asyncio.gather(*(worker(client, token) for _, token in spec.workers[:spec.concurrency]))
    return rec.groups


async def _cpu_in_window(rec: Record, window: Window) -> None:
    await asyncio.sleep(max(0.0, window.begin - time.monotonic()))
    cpu0 = time.process_time()
    await asyncio.sleep(max(0.0, window.end - time.monotonic()))
    rec.cpu_s = time.process_time() - cpu0


async def _timed(client: Any, rec: Record, window: Window, kind: str, path: str, token: str,
                 body: bytes, due: float | None = None) -> tuple[Any, bool]:
    """POST and record it if it completed inside the window; returns (response or None, counted).
    Latency runs from `due` (the scheduled send time) when given, else from now."""
    t0 = time.monotonic() if due is None else due
    try:
        r = await client.post(path, content=body, headers={"Authorization": f"Bearer {token}",
                                                           "Content-Type": "application/json"})
    except Exception as exc:  # a timeout or a dropped connection is a result, not a crash
        if (counted := time.monotonic() in window):
            rec.errors[f"{kind}: {type(exc).__name__}"] += 1
        return None, counted
    t1 = time.monotonic()
    if (counted := t1 in window):
        rec.latencies[kind].append(t1 - t0)
        rec.statuses[kind][r.status_code] += 1
    return r, counted


def _heartbeat_body(spec: ClientSpec) -> bytes:
    return json.dumps({"status": "active", "job_id": spec.job_id, "version_held": 0,
                       "versions_held": [0], "stats": {"rollouts_done": 10, "tokens_per_s": 2500.0}}).encode()


async def _heartbeat_paced(client: Any, spec: ClientSpec, rec: Record, window: Window) -> None:
    """Open loop: heartbeat i is due at start + i / rate whether or not earlier ones were answered."""
    body, in_flight = _heartbeat_body(spec), set()
    for i in itertools.count():
        due = spec.start_at + i / spec.rate
        if due >= window.end:
            break
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        worker_id, token = spec.workers[i % len(spec.workers)]
        task = asyncio.create_task(_timed(client, rec, window, "heartbeat", f"/v1/workers/{worker_id}/heartbeat",
                                          token, body, due))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    await asyncio.gather(*in_flight)


async def _heartbeat_loop(client: Any, spec: ClientSpec, mine: list[tuple[str, str]], rec: Record,
                          window: Window) -> None:
    body, i = _heartbeat_body(spec), 0
    while time.monotonic() < window.end:
        worker_id, token = mine[i % len(mine)]
        i += 1
        await _timed(client, rec, window, "heartbeat", f"/v1/workers/{worker_id}/heartbeat", token, body)


def _lease_body(spec: ClientSpec, version: int = 0, prompts: int | None = None) -> bytes:
    return json.dumps({"job_id": spec.job_id, "max_prompts": prompts or spec.lease_prompts,
                       "version": version}).encode()


async def _lease_loop(client: Any, spec: ClientSpec, mine: list[tuple[str, str]], rec: Record,
                      window: Window) -> None:
    body, i = _lease_body(spec), 0
    while time.monotonic() < window.end:
        _, token = mine[i % len(mine)]
        i += 1
        r, _ = await _timed(client, rec, window, "lease", "/v1/leases", token, body)
        if r is not None and r.status_code == 409:
            await asyncio.sleep(0.05)  # the pool is empty: back off as a worker would (Retry-After)


def _sample_pool(spec: ClientSpec, vocab: int, partial: bool, n: int = 32) -> list[str]:
    """Pre-serialised samples (token ids, behaviour logprobs, text), so building a body is cheap."""
    rng = random.Random(spec.seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(vocab) for _ in range(spec.tokens)]
        logprobs = [round(-rng.expovariate(2.0), 5) for _ in range(spec.tokens)]
        text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789 ") for _ in range(4 * spec.tokens))
        sample = {"token_ids": ids, "logprobs": logprobs, "text": text, "finish_reason": "stop"}
        if partial:  # one run of version 0: the only version the main job publishes
            sample["versions"] = [[0, spec.tokens]]
        out.append(json.dumps(sample))
    return out


def _group(prompt_id: int, version: int, prompt_ids: str, samples: list[str]) -> str:
    """One group's JSON from pre-serialised parts."""
    return (f'{{"prompt_id":{prompt_id},"version":{version},"prompt_token_ids":{prompt_ids},"gen_seconds":1.5,'
            f'"samples":[{",".join(samples)}]}}')


def _drawn(samples: list[str], prompt_id: int, spec: ClientSpec) -> list[str]:
    """A group's G samples from the pool, differing from each other (the door audits a group of twins)."""
    return [samples[(prompt_id + k) % len(samples)] for k in range(spec.group_size)]


async def _submit(client: Any, spec: ClientSpec, rec: Record, window: Window, token: str, lease_id: str,
                  groups: list[str]) -> None:
    """POST the groups, `--groups-per-request` at a time; count those accepted (and refused) in the window."""
    for b in range(0, len(groups), spec.groups_per_request):
        batch = groups[b:b + spec.groups_per_request]
        body = ('{"groups":[' + ",".join(batch) + "]}").encode()
        r, counted = await _timed(client, rec, window, "rollouts", f"/v1/leases/{lease_id}/rollouts", token, body)
        if r is None or r.status_code != 200 or not counted:
            continue
        accepted = sum(1 for g in r.json()["results"] if g["status"] == "accepted")
        rec.groups += accepted
        rec.rejected_groups += len(batch) - accepted


async def _lease_and_submit(client: Any, spec: ClientSpec, rec: Record, window: Window, token: str,
                            samples: list[str], lease_body: bytes) -> bool:
    """One round of the worker loop: lease, then submit a group for every leased prompt; False: no lease."""
    r, _ = await _timed(client, rec, window, "lease", "/v1/leases", token, lease_body)
    if r is None or r.status_code != 201:
        return False
    lease = r.json()
    groups = [_group(p["prompt_id"], 0, PROMPT_IDS, _drawn(samples, p["prompt_id"], spec)) for p in lease["prompts"]]
    await _submit(client, spec, rec, window, token, lease["id"], groups)
    return True


async def _rollout_loop(client: Any, spec: ClientSpec, mine: list[tuple[str, str]], rec: Record,
                        window: Window) -> None:
    samples, lease_body, i = _sample_pool(spec, VOCAB, spec.partial), _lease_body(spec), 0
    while time.monotonic() < window.end:
        _, token = mine[i % len(mine)]
        i += 1
        if not await _lease_and_submit(client, spec, rec, window, token, samples, lease_body):
            await asyncio.sleep(0.05)


def _verdicts(rollout_ids: list[str], spec: ClientSpec, rng: random.Random) -> bytes:
    """Passed audits with the statistics an honest group's replay gives (learner/audit.py: z about N(0, 1))."""
    tokens = float(spec.group_size * spec.tokens)
    return json.dumps({"step": 0, "audits": [
        {"rollout_id": i, "passed": True, "stats": {"tokens": tokens, "replayed": tokens, "near_ties": 0.0,
                                                     "max_abs_diff": 0.02, "mean_abs_diff": 0.003,
                                                     "z": round(rng.gauss(0.0, 1.0), 3)}}
        for i in rollout_ids]}).encode()


async def _audit_loop(client: Any, spec: ClientSpec, _: list[tuple[str, str]], rec: Record,
                      window: Window) -> None:
    """The learner: claim groups for step 0, then send its verdicts on those the claim picked for an audit."""
    learner, rng = f"/v1/jobs/{spec.job_id}/learner", random.Random(spec.seed)
    claim = json.dumps({"step": 0, "max_groups": spec.claim_groups}).encode()
    while time.monotonic() < window.end:
        r, counted = await _timed(client, rec, window, "claim", f"{learner}/claim", spec.token, claim)
        groups = r.json()["groups"] if r is not None and r.status_code == 200 else []
        if not groups:
            if r is not None and r.status_code == 200 and counted:
                rec.errors["claim: the queue ran dry (raise --audit-queue)"] += 1
            await asyncio.sleep(0.05)
            continue
        rec.groups += len(groups) if counted else 0
        if picked := [g["rollout_id"] for g in groups if g["audit"]]:
            r, counted = await _timed(client, rec, window, "audits", f"{learner}/audits", spec.token,
                                      _verdicts(picked, spec, rng))
            if r is not None and r.status_code == 200 and counted:
                rec.audits += r.json()["recorded"]


async def _episode_loop(client: Any, spec: ClientSpec, mine: list[tuple[str, str]], rec: Record,
                        window: Window) -> None:
    """The multi-turn worker loop: lease, play the leased episodes to their end, submit their groups."""
    lease_body, i = _lease_body(spec), 0
    while time.monotonic() < window.end:
        _, token = mine[i % len(mine)]
        i += 1
        r, _ = await _timed(client, rec, window, "lease", "/v1/leases", token, lease_body)
        if r is None or r.status_code != 201:
            await asyncio.sleep(0.05)
            continue
        lease = r.json()
        played = await _play(client, spec, rec, window, token, lease)
        if played is None:
            continue
        # The prompt's own tokens are not checked against the episodes (the door only bounds them by the vocabulary).
        groups = [_group(p["prompt_id"], 0, "[1,2,3]",
                         [json.dumps(played[p["prompt_id"], k]) for k in range(spec.group_size)])
                  for p in lease["prompts"]]
        await _submit(client, spec, rec, window, token, lease["id"], groups)


async def _play(client: Any, spec: ClientSpec, rec: Record, window: Window, token: str,
                lease: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]] | None:
    """Every episode of the lease (G per prompt) to its end, one request a turn for all those still going
    (as echo2_worker.episodes plays them); returns each as its sample, or None if a turn failed."""
    played = {(p["prompt_id"], k): {"token_ids": [], "logprobs": [], "finish_reason": "stop", "turns": []}
              for p in lease["prompts"] for k in range(spec.group_size)}
    going, turn = list(played), 0
    while going:
        moves = {key: spec.actions[(key[0] * 7 + key[1] + turn) % len(spec.actions)] for key in going}
        steps = [{"prompt_id": pid, "sample": k, "turn": turn, "action_token_ids": moves[pid, k]} for pid, k in going]
        r, counted = await _timed(client, rec, window, "episodes", f"/v1/leases/{lease['id']}/episodes", token,
                                  json.dumps({"steps": steps}).encode())
        if r is None or r.status_code != 200:
            return None
        rec.steps += len(steps) if counted else 0
        replies = r.json()["replies"]
        for key, reply in zip(going, replies, strict=True):
            _append(played[key], moves[key], -1.0)
            if not reply["done"]:  # the environment's tokens are no draw of the model's: logprob 0
                _append(played[key], reply["observation_token_ids"], 0.0)
        going, turn = [key for key, reply in zip(going, replies, strict=True) if not reply["done"]], turn + 1
    return played


def _append(sample: dict[str, Any], tokens: list[int], logprob: float) -> None:
    sample["token_ids"] += tokens
    sample["logprobs"] += [logprob] * len(tokens)
    sample["turns"].append(len(tokens))


async def _tinker_loop(client: Any, spec: ClientSpec, mine: list[tuple[str, str]], rec: Record,
                       window: Window) -> None:
    """A Tinker user asks for G samples on the sampler checkpoint; a worker of the fleet leases a request (one
    at a time: each loop leases after its own request, so one is always there) and answers it with its group."""
    from echo2.models import TINY_VOCAB_SIZE

    # Its job serves a snapshot checkpoint (no partial rollouts): each sample is one version's.
    samples, prompt_ids, i = _sample_pool(spec, TINY_VOCAB_SIZE, False), json.dumps(TINKER_PROMPT), 0
    ask = json.dumps({"sampling_session_id": spec.sampler, "num_samples": spec.group_size,
                      "prompt": {"chunks": [{"type": "encoded_text", "tokens": TINKER_PROMPT}]},
                      "sampling_params": {"max_tokens": spec.tokens, "temperature": 1.0}}).encode()
    lease_body = _lease_body(spec, version=1, prompts=1)
    while time.monotonic() < window.end:
        _, token = mine[i % len(mine)]
        i += 1
        r, _ = await _timed(client, rec, window, "asample", "/api/v1/asample", spec.token, ask)
        if r is not None and r.status_code == 200:
            r, _ = await _timed(client, rec, window, "lease", "/v1/leases", token, lease_body)
        if r is None or r.status_code != 201:
            await asyncio.sleep(0.05)
            continue
        lease = r.json()
        groups = [_group(p["prompt_id"], 1, prompt_ids, _drawn(samples, p["prompt_id"], spec))
                  for p in lease["prompts"]]
        await _submit(client, spec, rec, window, token, lease["id"], groups)


# ---------------------------------------------------------------- CPU accounting (/proc via psutil)


class CpuMeter:
    """CPU seconds of the server process, the database's processes and the whole machine over a window.

    PostgreSQL forks a backend per connection and SQLAlchemy's pool closes overflow connections, so
    the database's process tree is polled: a backend that exits mid-window still counts up to its
    last poll."""

    def __init__(self, server_pid: int, db_pid: int | None, poll_s: float = 0.2) -> None:
        import psutil

        self.psutil, self.poll_s = psutil, poll_s
        self.server = psutil.Process(server_pid)
        self.db_root = psutil.Process(db_pid) if db_pid else None

    def _server_tree(self) -> float:
        """The API: one process, or with --api-processes N uvicorn's supervisor and its N children."""
        return sum(self._tree(self.server).values())

    def _db_tree(self) -> dict[int, float]:
        return {} if self.db_root is None else self._tree(self.db_root)

    def _tree(self, root: Any) -> dict[int, float]:
        out = {}
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except self.psutil.Error:
                pass
        return out

    def _machine(self) -> float:
        t = self.psutil.cpu_times()
        return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)

    def measure(self, seconds: float) -> dict[str, float]:
        """Cores used by each side during the next `seconds`."""
        server0, machine0, t0 = self._server_tree(), self._machine(), time.monotonic()
        first = self._db_tree()
        last = dict(first)
        while (left := t0 + seconds - time.monotonic()) > 0:
            time.sleep(min(self.poll_s, left))
            last.update(self._db_tree())
        wall = time.monotonic() - t0
        db = sum(v - first.get(pid, 0.0) for pid, v in last.items())
        return {"server": (self._server_tree() - server0) / wall, "db": db / wall,
                "machine": (self._machine() - machine0) / wall, "db_procs_started": len(set(last) - set(first))}


# ---------------------------------------------------------------- phases and report


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _client_spec(phase: str, base_url: str, fleet: Fleet, workers: list[tuple[str, str]], concurrency: int,
                 start_at: float, seed: int, args: argparse.Namespace, rate: float = 0.0) -> ClientSpec:
    return ClientSpec(phase=phase, base_url=base_url, job_id=fleet.job_id, workers=workers, concurrency=concurrency,
                      start_at=start_at, warmup_s=args.warmup, duration_s=args.duration,
                      lease_prompts=args.lease_prompts, groups_per_request=args.groups_per_request,
                      group_size=args.group_size, tokens=args.tokens, seed=seed, rate=rate, partial=args.partial,
                      claim_groups=args.claim_groups, token=fleet.token, sampler=fleet.sampler, actions=fleet.actions)


def run_phase(phase: str, base_url: str, fleet: Fleet, meter: CpuMeter,
              args: argparse.Namespace) -> dict[str, Any]:
    conc = args.concurrency[phase]
    clients = min(args.clients, conc)
    start_at = time.monotonic() + 1.0 + 0.5 * clients  # time for every client process to start
    specs = [_client_spec(phase, base_url, fleet, fleet.workers[c::clients],
                          conc // clients + (1 if c < conc % clients else 0), start_at, c, args,
                          rate=args.heartbeat_rate / clients)
             for c in range(clients)]
    with ProcessPoolExecutor(max_workers=clients, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(client_main, s) for s in specs]
        # The CPU window matches the measurement window (after warmup).
        time.sleep(max(0.0, start_at + args.warmup - time.monotonic()))
        profiler = _start_profiler(meter.server.pid, f"{args.db_now}-{phase}", args)
        cores = meter.measure(args.duration)
        records = [f.result() for f in futures]
        if profiler is not None:
            profiler.wait(timeout=60)
    return _summarise(phase, records, cores, conc, clients, args)


def _start_profiler(pid: int, name: str, args: argparse.Namespace) -> subprocess.Popen[bytes] | None:
    """py-spy on the server for the measured window, as collapsed stacks."""
    if args.profile is None:
        return None
    args.profile.mkdir(parents=True, exist_ok=True)
    # cpu: only the thread holding the GIL, which is what caps one Python process. wall: every
    # thread, waiting included, which shows where requests queue on locks.
    mode = ["--gil"] if args.profile_mode == "cpu" else ["--idle"]
    cmd = [args.py_spy, "record", "--pid", str(pid), "--duration", str(int(args.duration)), "--rate", "100",
           *mode, *(["--subprocesses"] if args.api_processes > 1 else []), "--nonblocking", "--format", "raw",
           "--output", str(args.profile / f"{name}.txt")]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _idle(frames: list[str]) -> bool:
    """A thread-pool thread waiting for work, or the event loop waiting for I/O."""
    leaf = frames[-1]
    return (leaf.startswith("Condition.wait") and any(f.startswith("Queue.get") for f in frames)) or \
        leaf.startswith("Runner.run ") or leaf.startswith("Thread.join") or leaf.startswith("Event.wait")


def hot_spots(collapsed: Path, top: int = 15) -> list[str]:
    """Where the server's samples went: each of our own functions (api/, inclusive), then the
    innermost frame's package (self time). Idle threads are left out."""
    ours: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    total = 0
    # "\n" only: a frame's name may hold a character splitlines() also breaks at
    for line in filter(None, collapsed.read_text().split("\n")):
        stack, _, count = line.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        if _idle(frames):
            continue
        total += n
        for frame in {f for f in frames if "(api/" in f and "(server/cli.py" not in f}:
            ours[frame] += n
        where = frames[-1].rpartition("(")[2]
        packages["<stdlib>" if where.startswith("<") else where.split("/")[0].split(".py")[0]] += n
    if not total:
        return ["  (no busy samples)"]
    lines = [f"  {n / total:6.1%}  {frame}" for frame, n in ours.most_common(top)]
    lines.append("  self time by package: " + ", ".join(f"{k} {n / total:.0%}" for k, n in packages.most_common(8)))
    return lines


UNIT = {"heartbeat": "heartbeat", "paced": "heartbeat", "lease": "lease", "rollouts": "group", "audits": "audit",
        "episodes": "step", "tinker": "request"}
GROUPED = ("rollouts", "audits", "episodes", "tinker")  # phases that move groups (audits: claims them)
FIRST_ROW = {"tinker": "asample"}  # the endpoint listed first where it is not the phase's name


def _summarise(phase: str, records: list[Record], cores: dict[str, float], conc: int, clients: int,
               args: argparse.Namespace) -> dict[str, Any]:
    latencies: dict[str, list[float]] = defaultdict(list)
    statuses: dict[str, Counter[int]] = defaultdict(Counter)
    errors: Counter[str] = Counter()
    for r in records:
        for k, v in r.latencies.items():
            latencies[k].extend(v)
        for k, c in r.statuses.items():
            statuses[k].update(c)
        errors.update(r.errors)
    rows = [{"endpoint": kind, "requests": len(v), "rps": len(v) / args.duration,
             "p50_ms": 1000 * _pct(v, 0.50), "p99_ms": 1000 * _pct(v, 0.99),
             "mean_ms": 1000 * statistics.fmean(v),
             "statuses": {str(k): n for k, n in sorted(statuses[kind].items())}}
            for kind, v in sorted(latencies.items(), key=lambda kv: (kv[0] != FIRST_ROW.get(phase, phase), kv[0]))]
    offered = args.heartbeat_rate if phase == "paced" else None
    groups = sum(r.groups for r in records)
    # A Tinker fleet request is answered by its accepted group.
    ok = {"heartbeat": statuses["heartbeat"][200], "paced": statuses["heartbeat"][200],
          "lease": statuses["lease"][201], "rollouts": groups, "audits": sum(r.audits for r in records),
          "episodes": sum(r.steps for r in records), "tinker": groups}[phase]
    ops = ok / args.duration
    load_gen = sum(r.cpu_s for r in records) / args.duration
    return {
        "phase": phase, "concurrency": conc, "offered_per_s": offered, "clients": clients, "rows": rows,
        "errors": dict(errors),
        "unit": UNIT[phase], "ops_per_s": ops,
        "groups_per_s": groups / args.duration if phase in GROUPED else None,
        "samples_per_s": groups * args.group_size / args.duration if phase in GROUPED else None,
        "rejected_groups": sum(r.rejected_groups for r in records),
        "server_cpu_ms_per_op": 1000 * cores["server"] / ops if ops else None,
        "db_cpu_ms_per_op": 1000 * cores["db"] / ops if ops else None,
        "db_procs_started": cores["db_procs_started"],
        "cores": {"server": cores["server"], "db": cores["db"], "load_gen": load_gen,
                  "other": max(0.0, cores["machine"] - cores["server"] - cores["db"] - load_gen)},
    }


def run_database(kind: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from server.local import PostgresServer

    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"echo2-load-{kind}-")))
        db_pid = None
        if kind == "postgres":
            pg = stack.enter_context(PostgresServer())
            db_url, db_pid = pg.url, pg.proc.pid  # type: ignore[union-attr]
        else:
            db_url = f"sqlite:///{work / 'data' / 'echo2.db'}"
        (work / "data").mkdir(exist_ok=True)
        proc, base_url = stack.enter_context(api_server(db_url, work / "data", args.lease_ttl, args.api_processes))
        t0 = time.monotonic()
        fleet = build_fleet(base_url, db_url, work, args)
        _say(f"[{kind}] {len(fleet.workers)} workers, job {fleet.job_id} with {args.prompts} prompts "
             f"ready in {time.monotonic() - t0:.1f}s")
        meter = CpuMeter(proc.pid, db_pid)
        results = []
        args.db_now = kind
        for phase in args.phases:
            result = run_phase(phase, base_url, phase_fleet(phase, fleet, base_url, db_url, work, args), meter, args)
            result["db"] = kind
            results.append(result)
            _say(_format([result]))
            if args.profile is not None and (stacks := args.profile / f"{kind}-{phase}.txt").exists():
                _say("\n".join(hot_spots(stacks, args.top)))
            if phase == "lease":
                _say(f"[{kind}] released {release_leases(db_url, fleet.job_id)} leases before the next phase")
            if phase == "rollouts":
                result["storage"] = store = rollout_storage(db_url, args.group_size)
                if store["groups"]:
                    _say(f"[{kind}] rollouts table: {store['groups']} groups in {store['bytes'] / 2**20:.1f} MiB, "
                         f"{store['bytes_per_sample']:.0f} bytes per sample of {args.tokens} tokens = "
                         f"{store['gb_per_million_samples']:.2f} GB per million samples")
        return results


def _say(text: str) -> None:
    print(text, flush=True)


def _format(results: list[dict[str, Any]]) -> str:
    head = (f"{'db':<8} {'phase':<9} {'endpoint':<9} {'conc':>6} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
            f"{'ops/s':>7} {'groups/s':>8} {'samples/s':>9} {'CPU ms/op srv+db':>17}  {'cores srv/db/gen/other':<22}"
            "  statuses")
    lines = [head, "-" * len(head)]
    for res in results:
        c = res["cores"]
        cores = f"{c['server']:.2f}/{c['db']:.2f}/{c['load_gen']:.2f}/{c['other']:.2f}"
        for i, row in enumerate(res["rows"]):
            ops = f"{res['ops_per_s']:7.0f}" if i == 0 else f"{'':>7}"
            grouped = i == 0 and res["groups_per_s"] is not None
            groups = f"{res['groups_per_s']:8.0f}" if grouped else f"{'':>8}"
            samples = f"{res['samples_per_s']:9.0f}" if grouped else f"{'':>9}"
            cpu = (f"{res['server_cpu_ms_per_op']:.2f}+{res['db_cpu_ms_per_op']:.2f}/{res['unit']}"
                   if i == 0 and res["ops_per_s"] else "")
            lines.append(f"{res['db']:<8} {res['phase']:<9} {row['endpoint']:<9} {_conc(res):>6} "
                         f"{row['rps']:7.0f} {row['p50_ms']:7.1f} {row['p99_ms']:7.1f} {ops} {groups} {samples} "
                         f"{cpu:>17}  {cores if i == 0 else '':<22}  {row['statuses']}")
        if res["errors"]:
            lines.append(f"{'':<8} errors: {res['errors']}")
        if res["db_procs_started"]:
            lines.append(f"{'':<8} {res['db_procs_started']} PostgreSQL backends started during the window "
                         "(connections opened beyond the pool)")
    return "\n".join(lines)


def _conc(res: dict[str, Any]) -> str:
    return f"{res['offered_per_s']:.0f}/s" if res["offered_per_s"] else str(res["concurrency"])


def _targets(results: list[dict[str, Any]]) -> list[str]:
    out = []
    for res in results:
        main = res["rows"][0] if res["rows"] else None
        if main is None:
            continue
        if res["phase"] == "heartbeat":
            out.append(f"{res['db']}: heartbeats {res['ops_per_s']:.0f}/s at most with {res['concurrency']} in "
                       f"flight (target >= 1000): {'MET' if res['ops_per_s'] >= 1000 else 'MISSED'}")
        if res["phase"] == "paced":
            met = res["ops_per_s"] >= min(1000, 0.98 * res["offered_per_s"]) and main["p99_ms"] <= 50
            out.append(f"{res['db']}: {res['offered_per_s']:.0f} heartbeats/s offered, {res['ops_per_s']:.0f}/s "
                       f"answered, p99 {main['p99_ms']:.1f} ms (target >= 1000/s with p99 <= 50 ms): "
                       f"{'MET' if met else 'MISSED'}")
        if res["phase"] == "rollouts":
            ingest = next(r for r in res["rows"] if r["endpoint"] == "rollouts")
            as_samples = "MET" if res["samples_per_s"] >= 2000 else "MISSED"
            as_groups = "MET" if res["groups_per_s"] >= 2000 else "MISSED"
            out.append(f"{res['db']}: rollouts ingested {res['groups_per_s']:.0f} groups/s = "
                       f"{res['samples_per_s']:.0f} samples/s, p99 {ingest['p99_ms']:.0f} ms per POST; "
                       f"target >= 2000/s counted as samples: {as_samples}, as groups: {as_groups}")
    return out


def _concurrency(text: str) -> dict[str, int]:
    """`32` for every phase, or `heartbeat=32,lease=8,rollouts=16`."""
    if "=" not in text:
        return dict.fromkeys(PHASES, int(text))
    out = dict.fromkeys(PHASES, 16)
    for part in text.split(","):
        name, value = part.split("=")
        if name not in PHASES:
            raise argparse.ArgumentTypeError(f"unknown phase {name!r}; phases are {', '.join(PHASES)}")
        out[name] = int(value)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    p.add_argument("--phases", default=",".join(PHASES),
                   help="comma-separated subset of " + ",".join(PHASES) + ", run in that order (audits: the "
                   "learner's claims and verdicts; episodes: multi-turn episode steps; tinker: Tinker sampling "
                   "requests served by the worker fleet)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per phase")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each phase's window")
    p.add_argument("--workers", type=int, default=200, help="registered workers, each with its own token")
    p.add_argument("--relay-every", type=int, default=4,
                   help="every n-th worker advertises a relay URL (0: none)")
    p.add_argument("--concurrency", type=_concurrency,
                   default=_concurrency("heartbeat=32,paced=64,lease=16,rollouts=16,audits=4,episodes=4,tinker=16"),
                   help="requests in flight: one number, or per phase like heartbeat=32,lease=16,rollouts=16")
    p.add_argument("--heartbeat-rate", type=float, default=1000.0,
                   help="paced phase: heartbeats per second offered (open loop)")
    p.add_argument("--clients", type=int, default=2, help="load-generator processes")
    p.add_argument("--api-processes", type=int, default=1,
                   help="uvicorn processes of the API (echo2-server api --workers N); CPU is summed over them")
    p.add_argument("--prompts", type=int, default=100_000, help="prompts in the job's pool")
    p.add_argument("--lease-prompts", type=int, default=16, help="prompts per lease")
    p.add_argument("--group-size", type=int, default=8, help="G: samples per group")
    p.add_argument("--tokens", type=int, default=64, help="completion tokens per sample")
    p.add_argument("--groups-per-request", type=int, default=16, help="groups per rollout POST")
    p.add_argument("--claim-groups", type=int, default=16, help="audits: groups per learner claim")
    p.add_argument("--audit-queue", type=int,
                   help="audits: groups queued for the learner before the phase, default 2,000 per second of "
                   "warmup + duration (a claim that finds none is counted as an error)")
    p.add_argument("--partial", action="store_true",
                   help="a job with partial_rollouts on: every sample carries its per-token versions")
    p.add_argument("--lease-ttl", type=float, default=60.0, help="ECHO2_LEASE_TTL_S of the server")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--profile", type=Path, help="py-spy the server during each phase; collapsed stacks here")
    p.add_argument("--profile-mode", choices=["cpu", "wall"], default="cpu",
                   help="cpu: GIL holder only (what caps the process); wall: all threads, lock waits included")
    p.add_argument("--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy")),
                   help="py-spy executable (pip install py-spy; default: on PATH, else beside this Python)")
    p.add_argument("--top", type=int, default=25, help="functions to list per profiled phase")
    return p


def _revision() -> str:
    """The commit measured, and whether api/ differs from it (others may be editing the tree)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "api"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision"
    return f"{head}{' + uncommitted api/ changes' if dirty else ''}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    asked = {p for p in args.phases.split(",") if p}
    if unknown := asked - set(PHASES):
        _parser().error(f"unknown phases: {', '.join(sorted(unknown))}")
    # Always in PHASES' order: the lease phase's leases are released before rollouts, and the rollouts table is
    # sized right after the rollouts phase, before the episodes and Tinker jobs add groups of other shapes.
    args.phases = [p for p in PHASES if p in asked]
    if max(args.concurrency[p] for p in args.phases) > args.workers:
        _parser().error("concurrency cannot exceed --workers: each request in flight is its own worker's")
    kinds = ["sqlite", "postgres"] if args.db == "both" else [args.db]
    _say(f"load_api: {date.today()} at {_revision()}, {os.cpu_count()} CPUs, {args.clients} load-generator "
         f"processes, {args.duration:g}s per phase after {args.warmup:g}s warmup; "
         f"load average {os.getloadavg()[0]:.2f}")
    results = [r for kind in kinds for r in run_database(kind, args)]
    _say("\n" + _format(results))
    _say("ops/s and CPU ms/op: heartbeats, leases, accepted groups, audit verdicts recorded, episode steps "
         "answered, Tinker requests answered by an accepted group; server (+ PostgreSQL) CPU per op, the phase's "
         "other requests included. groups/s: accepted (audits: claimed). cores: CPU cores busy in the window: "
         "server / database / load generator / everything else on the machine")
    for line in _targets(results):
        _say(line)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
