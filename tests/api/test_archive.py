"""Rollout archives over the real API: groups nothing reads from the table any more (all of an ended job's; a
running job's trained long enough ago, or rejected) have their tokens moved out of the database into Parquet
files, and their rollouts, traces and the learner's replay read the same before and after
(api/services/archive.py)."""

from __future__ import annotations

import asyncio
import shutil
from datetime import timedelta

from sqlalchemy import event, select

from api.models import Job, Rollout, utcnow
from api.services import archive, retention
from tests.factories import (
    activate,
    fake_model_folder,
    new_provider,
    new_user,
    new_worker,
    ok,
    running_job,
    step_report,
    submit_group,
    traced_step,
)

STEPS = 20  # ECHO2_ARCHIVE_AFTER_STEPS; an ended job has all its groups archived anyway


def _reads(client, jid: str, ids: list[str], steps: int = 1) -> tuple:
    return (ok(client.get(f"/v1/jobs/{jid}/rollouts", params={"limit": 50})),
            [ok(client.get(f"/v1/jobs/{jid}/rollouts/{i}")) for i in ids],
            [ok(client.get(f"/v1/jobs/{jid}/traces", params={"step": t})) for t in range(steps)],
            ok(client.get(f"/v1/jobs/{jid}/report")))


def _archived(api, jid: str) -> dict[str, str | None]:
    with api.db.session() as db:
        return {r.id: r.archive for r in db.scalars(select(Rollout).where(Rollout.job_id == jid))}


def test_an_ended_jobs_rollouts_read_the_same_from_the_archive(api, tiny_model_dir):
    jid, ids, alice, _ = traced_step(api, tiny_model_dir)
    data_dir = api.server.settings.data_dir
    with api.db.session() as db:
        assert archive.sweep(db, data_dir, 1.0, 0) == {}  # running, and both groups in the fleet window
    ok(alice.post(f"/v1/jobs/{jid}/cancel"))
    before = _reads(alice, jid, ids)

    with api.db.session() as db:
        assert archive.sweep(db, data_dir, 1.0, STEPS) == {}  # ended moments ago: not yet
        job = db.get(Job, jid)
        job.finished_at -= timedelta(hours=2)
        db.commit()
        assert archive.sweep(db, data_dir, 1.0, STEPS) == {jid: len(ids)}
        assert archive.sweep(db, data_dir, 1.0, STEPS) == {}  # nothing left to move
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
        archive.sweep(db, data_dir, 0.0, STEPS)
        name = db.get(Rollout, ids[0]).archive
    (archive.archive_dir(data_dir) / name).unlink()
    response = alice.get(f"/v1/jobs/{jid}/rollouts/{ids[0]}")
    assert response.status_code == 500 and "is missing; restore it from backup" in response.text


def _trained_steps(api, tmp_path, steps: int):
    """A running job that trained one group of a worker at each of `steps` steps (with the learner's logprobs),
    then got a group the door rejected and one still queued. Returns (job id, trained ids by step, rejected id,
    queued id, owner, learner)."""
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "m"), staleness=8, max_steps=20,
                               grpo={"group_size": 2, "max_new_tokens": 3})
    jid = job["id"]
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, jid)
    lease = ok(worker.post("/v1/leases", json={"job_id": jid, "max_prompts": steps + 2, "version": 0}), 201)
    prompts = lease["prompts"]
    trained = []
    for t in range(steps):
        trained.append(ok(submit_group(worker, lease, prompts[t], 0))["results"][0]["rollout_id"])
        ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": t, "max_groups": 1}))
        report = step_report(t, [trained[-1]])
        report["rewards"][0]["learner_logprobs"] = [[-0.4, -0.9, -0.2], [-0.6, -1.1, -0.1]]
        ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=report))
    rejected = ok(submit_group(worker, lease, prompts[steps], 0, group_size=3))["results"][0]
    assert rejected["status"] == "rejected", rejected
    queued = ok(submit_group(worker, lease, prompts[steps + 1], 0))["results"][0]
    assert queued["status"] == "accepted", queued
    return jid, trained, rejected["rollout_id"], queued["rollout_id"], alice, learner


def _replays(learner, jid: str, steps: int) -> list:
    return [ok(learner.get(f"/v1/jobs/{jid}/learner/steps/{t}")) for t in range(steps)]


def test_a_running_jobs_old_groups_read_the_same_from_the_archive(api, tmp_path):
    jid, trained, rejected, queued, alice, learner = _trained_steps(api, tmp_path, steps=6)  # the job is at step 6
    data_dir = api.server.settings.data_dir
    ids = [*trained, rejected, queued]
    with api.db.session() as db:
        db.get(Rollout, rejected).created_at -= timedelta(hours=2)
        db.commit()
    before = _reads(alice, jid, ids, steps=6), _replays(learner, jid, 6)

    with api.db.session() as db:
        # Trained 3 or more steps ago: steps 0-3, but a running job's groups go out in whole files (of 3 here)
        assert archive.sweep(db, data_dir, 3.0, 3, keep_trained=1, per_file=3) == {jid: 3}
        # However old, the newest groups the fleet comparison reads (2 here) stay: only step 3's goes
        assert archive.sweep(db, data_dir, 3.0, 0, keep_trained=2, per_file=1) == {jid: 1}
        # The group rejected 2 hours ago goes once that is old enough
        assert archive.sweep(db, data_dir, 1.0, 0, keep_trained=2, per_file=1) == {jid: 1}
    where = _archived(api, jid)
    assert [where[i] is not None for i in ids] == [True] * 4 + [False] * 2 + [True, False]  # the queued one stays
    assert len({where[i] for i in trained[:3]}) == 1 and where[trained[3]] != where[trained[0]]
    assert (_reads(alice, jid, ids, steps=6), _replays(learner, jid, 6)) == before


def test_retention_deletes_an_ended_jobs_archive_and_says_so(api, tiny_model_dir):
    jid, ids, alice, _ = traced_step(api, tiny_model_dir)
    ok(alice.post(f"/v1/jobs/{jid}/cancel"))
    report = ok(alice.get(f"/v1/jobs/{jid}/report"))
    folder = archive.archive_dir(api.server.settings.data_dir) / jid
    settings = api.server.settings.model_copy(update={"archive_after_h": 0.0, "archive_keep_days": 1.0})

    def sweep() -> None:
        asyncio.run(retention.sweep_periodically(api.db, api.server.app.state.blobs, api.server.app.state.checkpoints,
                                                 settings))

    sweep()  # archived now, deleted only a day after the job ended
    assert len(list(folder.iterdir())) == 1 and None not in _archived(api, jid).values()
    with api.db.session() as db:
        db.get(Job, jid).finished_at -= timedelta(days=2)
        db.commit()
    sweep()
    assert not folder.exists()
    assert set(_archived(api, jid).values()) == {f"{archive.DELETED}{utcnow().date().isoformat()}"}
    for path in (f"/v1/jobs/{jid}/rollouts", f"/v1/jobs/{jid}/rollouts/{ids[0]}", f"/v1/jobs/{jid}/traces?step=0"):
        r = alice.get(path)
        assert r.status_code == 410 and "were deleted by retention on" in r.json()["detail"], (path, r.text)
    assert ok(alice.get(f"/v1/jobs/{jid}/report")) == report
    sweep()  # nothing left to delete


def test_retention_keeps_archives_by_default_and_waits_for_the_last_group(api, tmp_path):
    jid, trained, _, _, alice, _ = _trained_steps(api, tmp_path, steps=3)
    data_dir = api.server.settings.data_dir
    with api.db.session() as db:
        assert archive.sweep(db, data_dir, 1.0, 1, keep_trained=1, per_file=1) == {jid: 2}  # while it ran
    ok(alice.post(f"/v1/jobs/{jid}/cancel"))
    with api.db.session() as db:
        db.get(Job, jid).finished_at -= timedelta(days=2)
        db.commit()
        assert archive.drop_expired(db, data_dir, 0.0) == []  # 0: forever
        assert archive.drop_expired(db, data_dir, 1.0) == []  # groups still to archive (ECHO2_ARCHIVE_AFTER_H)
        assert archive.sweep(db, data_dir, 24.0, STEPS) == {jid: 3}
        assert archive.drop_expired(db, data_dir, 1.0) == [jid]

def _archived_ended_job(api, tiny_model_dir):  # -> (job id, rollout ids, its owner, its archive file)
    jid, ids, alice, _ = traced_step(api, tiny_model_dir)
    ok(alice.post(f"/v1/jobs/{jid}/cancel"))
    data_dir = api.server.settings.data_dir
    with api.db.session() as db:
        assert archive.sweep(db, data_dir, 0.0, STEPS) == {jid: len(ids)}
        name = db.get(Rollout, ids[0]).archive
    return jid, ids, alice, archive.archive_dir(data_dir) / name


def test_a_corrupt_archive_file_is_named_like_a_missing_one(api, tiny_model_dir):
    """A damaged archive file (truncated by a full disk, a bad restore) answers like a missing one: an error that
    names the file and says what to do, not a bare 'internal server error' an operator cannot act on."""
    jid, ids, alice, path = _archived_ended_job(api, tiny_model_dir)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated
    for route in (f"/v1/jobs/{jid}/rollouts/{ids[0]}", f"/v1/jobs/{jid}/rollouts", f"/v1/jobs/{jid}/traces?step=0"):
        r = alice.get(route)
        assert r.status_code >= 500, (route, r.text)
        assert str(path) in r.json()["detail"], (route, r.text)  # today: {"detail": "internal server error"}


def test_an_archive_another_process_deleted_first_does_not_fail_the_sweep(api, tiny_model_dir):
    """Every API process runs drop_expired at start and every ECHO2_RETENTION_SWEEP_S; two that find the same
    expired job both mark its rows and delete its folder. The one second to delete found nothing and raised,
    which ended that process's whole retention pass (episodes, Tinker results, uploads) as 'retention sweep
    failed'. Here the other process deletes the folder between this one's commit and its own deletion."""
    jid, _, _, path = _archived_ended_job(api, tiny_model_dir)
    with api.db.session() as db:
        db.get(Job, jid).finished_at -= timedelta(days=2)
        db.commit()
        event.listen(db, "after_commit", lambda _: shutil.rmtree(path.parent), once=True)
        assert archive.drop_expired(db, api.server.settings.data_dir, 1.0) == [jid]
    with api.db.session() as db:
        assert {r.archive for r in db.scalars(select(Rollout).where(Rollout.job_id == jid))} == {
            f"{archive.DELETED}{utcnow().date()}"}
