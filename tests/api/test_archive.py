"""Rollout archives over the real API: a job that ended has its groups' tokens moved out of the database into
Parquet files, and its rollouts and traces read the same before and after (api/services/archive.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from api.errors import ApiError
from api.models import Job, Rollout
from api.services import archive
from tests.factories import ok, traced_step


def _reads(client, jid: str, ids: list[str]) -> tuple:
    return (ok(client.get(f"/v1/jobs/{jid}/rollouts", params={"limit": 50})),
            [ok(client.get(f"/v1/jobs/{jid}/rollouts/{i}")) for i in ids],
            ok(client.get(f"/v1/jobs/{jid}/traces", params={"step": 0})),
            ok(client.get(f"/v1/jobs/{jid}/report")))


def test_an_ended_jobs_rollouts_read_the_same_from_the_archive(api, tiny_model_dir):
    jid, ids, alice, _ = traced_step(api, tiny_model_dir)
    data_dir = api.server.settings.data_dir
    with api.db.session() as db, pytest.raises(ApiError, match="only a job that ended is archived"):
        archive.archive_job(db, data_dir, db.get(Job, jid))
    ok(alice.post(f"/v1/jobs/{jid}/cancel"))
    before = _reads(alice, jid, ids)

    with api.db.session() as db:
        assert archive.sweep(db, data_dir, after_h=1.0) == {}  # ended moments ago: not yet
        job = db.get(Job, jid)
        job.finished_at -= timedelta(hours=2)
        db.commit()
        assert archive.sweep(db, data_dir, after_h=1.0) == {jid: len(ids)}
        assert archive.sweep(db, data_dir, after_h=1.0) == {}  # nothing left to move
        rows = db.scalars(select(Rollout).where(Rollout.job_id == jid)).all()
        assert {(r.samples == [], r.prompt_token_ids == [], r.learner_logprobs) for r in rows} == {(True, True, None)}
        files = {r.archive for r in rows}
    assert len(files) == 1 and (archive.archive_dir(data_dir) / files.pop()).stat().st_size > 0
    assert _reads(alice, jid, ids) == before


def test_a_missing_archive_file_is_named(api, tiny_model_dir):
    jid, ids, alice, _ = traced_step(api, tiny_model_dir)
    ok(alice.post(f"/v1/jobs/{jid}/cancel"))
    data_dir = api.server.settings.data_dir
    with api.db.session() as db:
        archive.archive_job(db, data_dir, db.get(Job, jid))
        name = db.get(Rollout, ids[0]).archive
    (archive.archive_dir(data_dir) / name).unlink()
    response = alice.get(f"/v1/jobs/{jid}/rollouts/{ids[0]}")
    assert response.status_code == 500 and "is missing; restore it from backup" in response.text
