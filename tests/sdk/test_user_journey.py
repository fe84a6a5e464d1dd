"""A new user's walk through a job's life (submit, watch, budget, cancel, resume, checkpoints, export, ledger,
evaluation, listing): what a review found (docs/RELIABILITY.md, "Found by a new user's review"), a test each."""

from __future__ import annotations

import pytest
from echo2 import errors

from tests.factories import (
    forms,
    ok,
    publish_forms,
    running_job,
    version_folder,
)


def test_a_cancelled_job_whose_newest_version_is_a_delta_can_still_be_downloaded_and_exported(api, alice, tmp_path):
    """The learner publishes versions between keyframes as deltas only (weights.delta, keyframe_every 10). A
    user who cancels such a job once it learned something must still get its weights: README says the final
    (or newest) version stays for `echo2 checkpoints download|export`."""
    user = api.client(alice.key)
    job, learner = running_job(api, user, version_folder(tmp_path, 0), staleness=1, max_steps=50)
    jid = job["id"]
    for v in (1, 2, 3):
        ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json={**_empty_step(v - 1)}))
        publish_forms(learner, jid, forms(tmp_path, v, full=False))  # as the learner publishes them
    ok(user.post(f"/v1/jobs/{jid}/cancel"))
    got = user.get(f"/v1/jobs/{jid}/checkpoint")
    assert got.status_code == 200, f"{got.status_code}: {got.text}"
    exported = user.get(f"/v1/jobs/{jid}/export")
    assert exported.status_code == 200, f"{exported.status_code}: {exported.text}"


def _empty_step(step: int) -> dict:
    from tests.factories import step_report

    return step_report(step, [])


def _adapter_version(learner, job_id: str, root, base: dict, version: int) -> None:
    """Publish a LoRA adapter version as the learner does: adapter_config.json + adapter_model.safetensors, in
    full, naming the base version (0)."""
    import json as _json

    import numpy as np
    from echo2.deltas import files_digest
    from echo2.protocol import AdapterInfo, Manifest
    from echo2.snapshots import build_manifest
    from safetensors.numpy import save_file

    folder = root / f"adapter{version}"
    folder.mkdir(parents=True)
    save_file({"lora_A": np.ones((4, 64), dtype="float32") * version}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(_json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    manifest = build_manifest(folder, version, version)
    base_manifest = Manifest.model_validate(base)
    manifest = manifest.model_copy(update={"adapter": AdapterInfo(
        base_version=0, base_digest=files_digest(base_manifest.target_files()))})
    publish_forms(learner, job_id, [(folder, manifest)])


def test_export_of_a_cancelled_lora_job_does_not_tell_the_user_to_wait_for_it_to_finish(api, alice, tmp_path):
    """A LoRA job cancelled (or failed) before its merged final version: `echo2 checkpoints export JOB` says
    "export the adapter (--adapter), or wait for the job to finish". The job will never finish: the error
    must not send the user waiting, only to what works (--adapter)."""
    user = api.client(alice.key)
    job, learner = running_job(api, user, version_folder(tmp_path, 0), staleness=1, max_steps=50,
                               lora={"rank": 4, "alpha": 8})
    jid = job["id"]
    base = ok(user.get(f"/v1/jobs/{jid}/versions/0/manifest"))
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=_empty_step(0)))
    _adapter_version(learner, jid, tmp_path, base, 1)
    ok(user.post(f"/v1/jobs/{jid}/cancel"))
    assert user.get(f"/v1/jobs/{jid}/export", params={"adapter": True}).status_code == 200  # what works
    refused = user.get(f"/v1/jobs/{jid}/export")
    assert refused.status_code == 409, refused.text
    detail = refused.json()["detail"]
    assert "--adapter" in detail
    assert "wait for the job to finish" not in detail, detail


def test_jobs_report_does_not_say_a_job_has_no_held_out_prompts_when_it_has_them(api, alice):
    """Every arithmetic job holds problems out (eval.size 64 by default). Before its learner reported an evaluation
    (queued, starting, or cancelled before it), `echo2 jobs report` says "not measured (no held-out prompts)": the
    user concludes evaluation is off for the job and goes looking for a setting that is already on."""
    from .test_cli import echo2

    user = api.client(alice.key)
    job = ok(user.post("/v1/jobs", json={"name": "r", "base_model": "echo2:tiny", "task": {"name": "arithmetic"},
                                         "grpo": {"group_size": 2, "prompts_per_step": 4}, "max_steps": 3}), 201)
    held = ok(user.get(f"/v1/jobs/{job['id']}/prompts", params={"held_out": True}))
    assert held["total"] > 0  # the job does hold prompts out
    report = echo2("jobs", "report", job["id"], url=api.url, key=alice.key)
    assert report.returncode == 0, report.stderr
    assert "no held-out prompts" not in report.stdout, report.stdout


def test_the_report_of_a_job_resumed_after_its_budget_counts_the_learner_time_before_the_pause(api, alice, tmp_path):
    """README: a job its budget paused is raised with `echo2 jobs budget` and a new learner resumes it. Each
    learner process heartbeats its own busy/wall seconds since *it* started, and the control plane overwrites
    the job's with them: after the resume `echo2 jobs report` shows the new learner's few seconds as the job's
    learner time and utilisation, though the learner before the pause worked (and was billed) for far longer."""
    from tests.factories import bill_past_budget, run_tick

    user = api.client(alice.key)
    job, first = running_job(api, user, version_folder(tmp_path, 0), budget_usd=0.5,
                             learner={"price_per_hour": 3600.0})
    jid = job["id"]
    ok(first.post(f"/v1/jobs/{jid}/learner/heartbeat", json={"step": 0, "busy_s": 600.0, "wall_s": 1000.0}))
    bill_past_budget(api, jid)
    assert ok(user.get(f"/v1/jobs/{jid}"))["paused_for"] == "budget"
    ok(user.patch(f"/v1/jobs/{jid}", json={"budget_usd": 1000.0}))
    _, launched = run_tick(api)
    second = api.client(launched[0][1])
    ok(second.post(f"/v1/jobs/{jid}/learner/start"))
    ok(second.post(f"/v1/jobs/{jid}/learner/heartbeat", json={"step": 0, "busy_s": 1.0, "wall_s": 2.0}))
    report = ok(user.get(f"/v1/jobs/{jid}/report"))
    assert report["learner_busy_s"] >= 600.0 and report["learner_wall_s"] >= 1000.0, report


def test_a_finished_jobs_report_counts_no_group_as_waiting(api, alice, driven):
    """Groups accepted but not trained when the job ends (cancelled, or the last step taken while workers had
    more in flight) are reported as "waiting" forever, by `echo2 jobs report` and at the end of `echo2 jobs
    watch`: nothing will ever train them, and they are left out of wasted_fraction too."""
    from tests.factories import activate, new_provider, new_worker, submit_group

    _, provider = new_provider(api, "late-co")
    wid, worker = new_worker(api, provider, name="late")
    activate(api, wid, driven.id)
    lease = ok(worker.post("/v1/leases", json={"job_id": driven.id, "max_prompts": 2, "version": 1}), 201)
    for p in lease["prompts"]:
        assert ok(submit_group(worker, lease, p, 1))["results"][0]["status"] == "accepted"
    alice.client.jobs.cancel(driven.id)
    report = alice.client.jobs.report(driven.id)
    assert report.rollouts.waiting == 0, report.rollouts


def test_budget_messages_show_the_amounts_the_user_gave_not_rounded_to_cents(api, alice, tmp_path):
    """Trying the platform on echo2:tiny with a small budget (--budget 0.004 at $3/h): the pause says "budget of
    $0.00 exhausted ($0.00 spent)" while `echo2 jobs get` shows the cost as $0.0042, and `echo2 jobs budget JOB
    0.0045` answers "budget $0.00" (0.005: "$0.01"). Money the user set or spent must be shown as precisely as the
    job's cost is (4 decimals), never as $0.00 for an amount that is not zero."""
    from datetime import timedelta

    from api.models import Job, utcnow
    from tests.factories import run_tick

    from .test_cli import echo2

    user = api.client(alice.key)
    job, _ = running_job(api, user, version_folder(tmp_path, 0), budget_usd=0.004, learner={"price_per_hour": 3.0})
    jid = job["id"]
    now = utcnow()
    with api.db.session() as s:
        s.get(Job, jid).learner_heartbeat_at = now
        s.commit()
    run_tick(api, now=now)
    run_tick(api, now=now + timedelta(seconds=5))  # $3/h for 5 s: $0.0042 > $0.004
    paused = ok(user.get(f"/v1/jobs/{jid}"))
    assert paused["paused_for"] == "budget"
    assert paused["status_reason"].startswith("budget of $0.0040 exhausted ($0.004"), paused["status_reason"]
    answered = echo2("jobs", "budget", jid, "0.0045", url=api.url, key=alice.key)
    assert answered.returncode == 0, answered.stderr
    assert "budget $0.0045" in answered.stdout, answered.stdout


def test_checkpoints_download_without_version_works_mid_training(api, alice, tmp_path):
    """`echo2 checkpoints download JOB DIR` (help: "default: the final checkpoint, else the latest") on a running
    job: its newest version is a delta nine times in ten (keyframe_every 10), and the default answers 409 "published
    only as a delta". With no version named, the newest version stored in full is what the user can have."""
    user = api.client(alice.key)
    job, learner = running_job(api, user, version_folder(tmp_path, 0), staleness=1, max_steps=50)
    jid = job["id"]
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=_empty_step(0)))
    publish_forms(learner, jid, forms(tmp_path, 1, full=True))  # a keyframe
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=_empty_step(1)))
    publish_forms(learner, jid, forms(tmp_path, 2, full=False))
    try:
        path = alice.client.checkpoints.download(jid, tmp_path / "ckpt")
    except errors.APIStatusError as exc:
        pytest.fail(f"the default download failed: {exc}")
    assert (path / "model.safetensors").exists()


def test_money_reads_whole_cents_through_float_noise():
    from echo2.money import usd

    assert (usd(0.1 + 0.2), usd(10.0), usd(0.004), usd(0.0045)) == ("$0.30", "$10.00", "$0.0040", "$0.0045")
