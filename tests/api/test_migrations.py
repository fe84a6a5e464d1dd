"""Migrations on both databases: head matches the ORM models exactly, 0005 gives every job that already
exists its own relay secret, on PostgreSQL 0028 compresses the rollouts' tokens with lz4, and no downgrade
past 0025 drops the only link from archived rollouts to their tokens."""

from __future__ import annotations

import argparse
import json
import uuid
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from api.db import Database
from api.migrate import alembic_config, upgrade
from api.models import Base, Rollout
from api.services import archive
from bench.db_size import fill


@pytest.fixture(params=["sqlite", "postgres"])
def empty_database(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fresh.db'}"
    return _fresh_postgres(request)


@pytest.fixture
def empty_postgres(request: pytest.FixtureRequest) -> str:
    return _fresh_postgres(request)


def _fresh_postgres(request: pytest.FixtureRequest) -> str:
    server = sa.make_url(request.getfixturevalue("postgres_url"))
    name = f"migrations_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    request.addfinalizer(lambda: _drop(admin, name))
    return server.set(database=name).render_as_string(hide_password=False)


def _drop(admin: sa.Engine, name: str) -> None:
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    admin.dispose()


def test_head_matches_the_models(empty_database):
    upgrade(empty_database)
    engine = sa.create_engine(empty_database)
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    engine.dispose()


def _compression(url: str) -> dict[str, str]:
    """Each rollouts column's TOAST compression as PostgreSQL stores it ('' for its default, pglz)."""
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT attname, attcompression FROM pg_attribute WHERE attrelid = "
                                    "'rollouts'::regclass AND attnum > 0 AND NOT attisdropped"))
        found = {name: str(method or "") for name, method in rows}
    engine.dispose()
    return found


def test_the_rollouts_tokens_are_compressed_with_lz4_on_postgres(empty_postgres):
    upgrade(empty_postgres)
    tokens = {"prompt_token_ids", "samples", "rewards", "learner_logprobs"}
    compression = _compression(empty_postgres)
    assert {c: compression[c] for c in tokens} == dict.fromkeys(tokens, "l")
    assert {c for c, method in compression.items() if method} == tokens  # nothing else changed

    command.downgrade(alembic_config(empty_postgres), "0027")
    assert {c: _compression(empty_postgres)[c] for c in tokens} == dict.fromkeys(tokens, "p")


def _job_row(job_id: str, now: datetime, **columns: object) -> dict[str, object]:
    """A jobs row as an old revision's table takes it (the columns every revision since 0004 requires)."""
    return {"id": job_id, "owner_id": "usr_1", "name": "old", "status": "running", "spec": {}, "step": 0,
            "num_prompts": 0, "learner_usd": 0.0, "workers_usd": 0.0, "learner_busy_s": 0.0, "learner_wall_s": 0.0,
            "learner_launches": 0, "created_at": now, **columns}


def test_existing_jobs_get_their_own_relay_secret(empty_database):
    upgrade(empty_database, "0004")
    engine = sa.create_engine(empty_database)
    meta = sa.MetaData()
    users, jobs = (sa.Table(name, meta, autoload_with=engine) for name in ("users", "jobs"))
    now = datetime.now(UTC)
    with engine.begin() as conn:
        conn.execute(users.insert().values(id="usr_1", name="alice", role="user", created_at=now))
        conn.execute(jobs.insert(), [_job_row(f"job_{i}", now) for i in range(3)])
    upgrade(empty_database)
    with engine.connect() as conn:
        secrets = [row[0] for row in conn.execute(sa.text("SELECT relay_secret FROM jobs"))]
    engine.dispose()
    assert len(set(secrets)) == 3 and all(len(bytes.fromhex(s)) == 32 for s in secrets)


def test_existing_tinker_fleet_jobs_become_that_kind(empty_database):
    upgrade(empty_database, "0023")
    engine = sa.create_engine(empty_database)
    meta = sa.MetaData()
    users, jobs = (sa.Table(name, meta, autoload_with=engine) for name in ("users", "jobs"))
    now = datetime.now(UTC)
    row = {"relay_secret": "00" * 32}
    with engine.begin() as conn:
        conn.execute(users.insert().values(id="usr_1", name="alice", role="user", created_at=now))
        conn.execute(jobs.insert(), [_job_row("job_grpo", now, **row, tinker_model_id=None),
                                     _job_row("job_fleet", now, **row, tinker_model_id="tks_1:train:0")])
    upgrade(empty_database)
    with engine.connect() as conn:
        kinds = dict(conn.execute(sa.text("SELECT id, kind FROM jobs")).all())
    engine.dispose()
    assert kinds == {"job_grpo": "grpo", "job_fleet": "tinker_fleet"}


def test_existing_decisions_become_runs_of_one(empty_database):
    upgrade(empty_database, "0025")
    engine = sa.create_engine(empty_database)
    decisions = sa.Table("decisions", sa.MetaData(), autoload_with=engine)
    then = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    with engine.begin() as conn:
        conn.execute(decisions.insert(), [{"job_id": "job_1", "worker_id": f"wrk_{i}", "action": "kept",
                                           "line": "kept", "trigger": "tick", "inputs": {}, "created_at": then}
                                          for i in range(2)])
    upgrade(empty_database)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT repeats, decided_at = created_at FROM decisions")).all()
    engine.dispose()
    assert [tuple(r) for r in rows] == [(1, True), (1, True)]


def test_a_state_and_a_sampler_checkpoint_may_share_a_name_after_upgrade_and_the_state_stays_on_downgrade(
        empty_database):
    upgrade(empty_database, "0031")
    engine = sa.create_engine(empty_database)
    meta = sa.MetaData()
    users, sessions, models, checkpoints = (sa.Table(name, meta, autoload_with=engine) for name in (
        "users", "tinker_sessions", "tinker_models", "tinker_checkpoints"))
    now = datetime.now(UTC)
    row = {"model_id": "m", "name": "000010", "step": 10, "created_at": now, "inflight": False}
    with engine.begin() as conn:  # the parents' rows, with the columns revision 0031 requires
        conn.execute(users.insert().values(id="usr_1", name="alice", role="user", created_at=now))
        conn.execute(sessions.insert().values(id="s", owner_id="usr_1", sdk_version="0.38.0", tags=[],
                                              status="active", heartbeat_at=now, created_at=now))
        conn.execute(models.insert().values(id="m", session_id="s", owner_id="usr_1", kind="train",
                                            base_model="echo2:tiny", status="ready", info={}, created_at=now))
        conn.execute(checkpoints.insert().values(kind="training", sha256="ab" * 32, **row))
    upgrade(empty_database)
    with engine.begin() as conn:
        conn.execute(checkpoints.insert().values(kind="sampler", **row))
    with engine.connect() as conn:
        assert sorted(r[0] for r in conn.execute(sa.text("SELECT kind FROM tinker_checkpoints"))) == \
            ["sampler", "training"]
    command.downgrade(alembic_config(empty_database), "0031")
    with engine.connect() as conn:
        assert [tuple(r) for r in conn.execute(sa.text("SELECT kind, sha256 FROM tinker_checkpoints"))] == \
            [("training", "ab" * 32)]
    engine.dispose()


def test_the_sampler_checkpoints_of_sessions_that_ended_before_0038_are_deleted_and_states_stay(empty_database):
    upgrade(empty_database, "0037")
    engine = sa.create_engine(empty_database)
    meta = sa.MetaData()
    users, sessions, models, checkpoints = (sa.Table(name, meta, autoload_with=engine) for name in (
        "users", "tinker_sessions", "tinker_models", "tinker_checkpoints"))
    now = datetime.now(UTC)
    session = {"owner_id": "usr_1", "sdk_version": "0.38.0", "tags": [], "heartbeat_at": now, "created_at": now}
    model = {"owner_id": "usr_1", "kind": "train", "base_model": "echo2:tiny", "status": "ready", "info": {},
             "created_at": now}
    row = {"name": "final", "step": 1, "created_at": now, "inflight": False}
    with engine.begin() as conn:
        conn.execute(users.insert().values(id="usr_1", name="alice", role="user", created_at=now))
        conn.execute(sessions.insert(), [{**session, "id": "live", "status": "active"},
                                         {**session, "id": "ended", "status": "finished"}])
        conn.execute(models.insert(), [{**model, "id": "m_live", "session_id": "live"},
                                       {**model, "id": "m_ended", "session_id": "ended"}])
        conn.execute(checkpoints.insert(), [{**row, "model_id": "m_live", "kind": "sampler"},
                                            {**row, "model_id": "m_ended", "kind": "sampler"},
                                            {**row, "model_id": "m_ended", "kind": "training", "sha256": "ab" * 32}])
    upgrade(empty_database)
    with engine.connect() as conn:
        left = sorted(tuple(r) for r in conn.execute(sa.text("SELECT model_id, kind FROM tinker_checkpoints")))
    engine.dispose()
    assert left == [("m_ended", "training"), ("m_live", "sampler")]


def test_a_workers_unpaid_time_becomes_its_current_jobs_and_back(empty_database):
    upgrade(empty_database, "0032")
    engine = sa.create_engine(empty_database)
    meta = sa.MetaData()
    users, jobs, providers, workers = (sa.Table(name, meta, autoload_with=engine)
                                       for name in ("users", "jobs", "providers", "workers"))
    now = datetime.now(UTC)
    worker = {"provider_id": "prv_1", "name": "w", "gpu_model": "cpu", "gpu_count": 0, "vram_gb": 0.0,
              "price_per_hour": 1.0, "region": "x", "upload_mbps": 1.0, "download_mbps": 1.0, "backends": [],
              "rollouts_per_s": 1.0, "tokens_per_s": 1.0, "software": "{}", "status": "active", "desired": "active",
              "stats": {}, "accepted_rollouts": 0, "rejected_rollouts": 0, "bad_chunks": 0, "created_at": now,
              "audit_salt": "00"}
    with engine.begin() as conn:
        conn.execute(users.insert().values(id="usr_1", name="alice", role="user", created_at=now))
        conn.execute(jobs.insert(), [_job_row("job_a", now, relay_secret="00" * 32)])
        conn.execute(providers.insert().values(id="prv_1", name="p", earnings_usd=0.0, created_at=now))
        conn.execute(workers.insert(), [{**worker, "id": "on", "job_id": "job_a", "unbilled_s": 42.0},
                                        {**worker, "id": "idle", "job_id": None, "unbilled_s": 7.0}])
    upgrade(empty_database)
    with engine.connect() as conn:
        pots = dict(conn.execute(sa.text("SELECT id, unbilled FROM workers")).all())
    assert {k: json.loads(v) if isinstance(v, str) else v for k, v in pots.items()} == {"on": {"job_a": 42.0},
                                                                                         "idle": {}}
    command.downgrade(alembic_config(empty_database), "0032")
    with engine.connect() as conn:
        assert dict(conn.execute(sa.text("SELECT id, unbilled_s FROM workers")).all()) == {"on": 42.0, "idle": 0.0}
    engine.dispose()


def test_a_downgrade_past_0025_is_refused_while_rollouts_are_archived(empty_database, tmp_path):
    """An archived rollout keeps empty token columns and names its Parquet file only in `archive`: 0025's
    downgrade dropped that column, so every archived group read as one of no samples and its file was named by
    nothing. The migration cannot put the tokens back (it is not told the API's data dir, and retention may have
    deleted the files), so it refuses, saying what to do; the rows keep their link and their tokens read as
    before once the database is back at head."""
    upgrade(empty_database)
    db = Database(empty_database)
    fill(db, argparse.Namespace(steps=2, groups=4, group_size=2, new_tokens=3, prompt_tokens=4))
    with db.session() as s:
        assert sum(archive.sweep(s, tmp_path, 0.0, 0).values()) == 8
        files = {r.id: r.archive for r in s.scalars(sa.select(Rollout))}
    db.dispose()

    with pytest.raises(RuntimeError, match=r"^8 rollouts are archived: .* Downgrade to 0025 at the lowest, or "
                                           r"restore a backup of the database taken before 0025 was applied$"):
        command.downgrade(alembic_config(empty_database), "0024")
    upgrade(empty_database)  # SQLite stops at 0025, PostgreSQL rolls the whole downgrade back
    db = Database(empty_database)
    with db.session() as s:
        rows = list(s.scalars(sa.select(Rollout)))
        assert {r.id: r.archive for r in rows} == files
        assert [len(p.samples) for p in archive.payloads(tmp_path, rows).values()] == [2] * 8
    db.dispose()
