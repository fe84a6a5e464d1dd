"""Learner checkpoints through the control plane, and committed steps for replay: what a learner relaunched
on another host needs to resume exactly."""

from __future__ import annotations

from echo2.protocol import Manifest
from echo2.snapshots import assemble, build_manifest, iter_stream

from tests.factories import SHA, drive_job, fake_model_folder, new_job, new_user, ok


def upload(learner, job_id, folder, step):
    manifest = build_manifest(folder, step, step, 4096)
    for info, data in zip(manifest.chunks, iter_stream(folder, manifest.files, 4096), strict=True):
        r = learner.put(f"/v1/jobs/{job_id}/learner/checkpoints/{step}/chunks/{info.index}", content=data,
                        headers={SHA: info.sha256, "Content-Type": "application/octet-stream"})
        assert r.status_code == 204, r.text
    return learner.post(f"/v1/jobs/{job_id}/learner/checkpoints", json=manifest.model_dump(mode="json"))


def test_a_checkpoint_round_trips_and_only_the_newest_two_are_kept(api, tmp_path):
    _, alice = new_user(api)
    job = new_job(alice)
    driven = drive_job(api, job["id"], fake_model_folder(tmp_path / "m"))  # one committed step
    learner, jid = driven.learner, job["id"]
    assert learner.get(f"/v1/jobs/{jid}/learner/checkpoints/latest").status_code == 404
    ahead = upload(learner, jid, fake_model_folder(tmp_path / "c5", seed=5), step=5)
    assert ahead.status_code == 409  # only one step is committed
    for step in (0, 1):
        ok(upload(learner, jid, fake_model_folder(tmp_path / f"c{step}", seed=step), step=step), 201)
    assert ok(learner.post(f"/v1/jobs/{jid}/learner/start"))["checkpoint_step"] == 1
    manifest = ok(learner.get(f"/v1/jobs/{jid}/learner/checkpoints/latest"))
    got = assemble(Manifest.model_validate(manifest), lambda i: learner.get(
        f"/v1/jobs/{jid}/learner/checkpoints/1/chunks/{i}").raise_for_status().content, tmp_path / "back")
    assert (got / "model.safetensors").read_bytes() == (tmp_path / "c1" / "model.safetensors").read_bytes()
    assert alice.get(f"/v1/jobs/{jid}/learner/checkpoints/latest").status_code == 403  # the learner's alone
    checkpoints = api.server.app.state.checkpoints
    assert checkpoints.finals(jid) == [0, 1]
    driven.finish()
    assert checkpoints.finals(jid) == []  # an ended job resumes from nothing


def test_a_committed_step_replays_in_its_trained_order_with_its_rewards(api, tmp_path):
    _, alice = new_user(api)
    job = new_job(alice)
    driven = drive_job(api, job["id"], fake_model_folder(tmp_path / "m"))
    step = ok(driven.learner.get(f"/v1/jobs/{job['id']}/learner/steps/0"))
    assert [g["rollout_id"] for g in step["groups"]] == driven.rollout_ids
    assert all(g["reference"] is not None and g["samples"] for g in step["groups"])
    assert step["rewards"] == {r: [1.0, 0.0] for r in driven.rollout_ids}
    assert driven.learner.get(f"/v1/jobs/{job['id']}/learner/steps/1").status_code == 404
