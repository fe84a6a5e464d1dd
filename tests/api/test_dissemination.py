"""Per-version dissemination: when each targeted worker first reported holding a version."""

from echo2.protocol import WorkerStatus

from api.models import Worker
from tests.factories import (
    activate,
    fake_model_folder,
    new_job,
    new_provider,
    new_user,
    new_worker,
    ok,
    publish,
    start_learner,
)


def _beat(worker, worker_id: str, job_id: str, held: int | None) -> dict:
    return ok(worker.post(f"/v1/workers/{worker_id}/heartbeat",
                          json={"status": "active", "job_id": job_id, "version_held": held}))


def _versions(user, job_id: str) -> dict[int, dict]:
    return {v["version"]: v for v in ok(user.get(f"/v1/jobs/{job_id}/versions"))}


def _job_with_two_workers(api, tmp_path):
    _, alice = new_user(api)
    job = new_job(alice)
    learner = start_learner(api, job["id"])
    _, provider = new_provider(api)
    workers = [new_worker(api, provider, name=f"w{i}") for i in range(2)]
    for worker_id, _ in workers:
        activate(api, worker_id, job["id"])
    return alice, job["id"], learner, workers


def test_dissemination_waits_for_every_targeted_worker(api, tmp_path):
    alice, job_id, learner, [(a_id, a), (b_id, b)] = _job_with_two_workers(api, tmp_path)
    folder = fake_model_folder(tmp_path / "m")
    published = publish(learner, job_id, folder, version=0, step=0)
    assert published["workers_targeted"] == 2 and published["workers_holding"] == 0
    assert published["dissemination_s"] is None

    _beat(a, a_id, job_id, 0)
    v0 = _versions(alice, job_id)[0]
    assert v0["workers_holding"] == 1 and v0["dissemination_s"] is None  # b is still fetching

    _beat(b, b_id, job_id, 0)
    _beat(b, b_id, job_id, 0)  # a repeat is not a new first report
    v0 = _versions(alice, job_id)[0]
    assert v0["workers_holding"] == 2
    assert 0 <= v0["dissemination_s"] < 30


def test_workers_gone_or_ahead_are_not_waited_for(api, tmp_path):
    alice, job_id, learner, [(a_id, a), (b_id, b)] = _job_with_two_workers(api, tmp_path)
    for version in (0, 1, 2):
        publish(learner, job_id, fake_model_folder(tmp_path / f"m{version}", seed=version), version=version,
                step=version)
    _beat(a, a_id, job_id, 0)
    _beat(b, b_id, job_id, 2)  # b skipped 0 and 1: it went straight to the newest
    versions = _versions(alice, job_id)
    assert versions[0]["workers_holding"] == 1 and versions[0]["dissemination_s"] is not None
    assert versions[2]["workers_holding"] == 1 and versions[2]["dissemination_s"] is None  # a fetches 2

    with api.db.session() as s:  # a stops beating: the offline sweep marks it so (a worker may not say it)
        s.get_one(Worker, a_id).status = WorkerStatus.offline
        s.commit()
    assert _versions(alice, job_id)[2]["dissemination_s"] is not None


def test_unknown_versions_and_other_jobs_are_not_recorded(api, tmp_path):
    alice, job_id, learner, [(a_id, a), _] = _job_with_two_workers(api, tmp_path)
    publish(learner, job_id, fake_model_folder(tmp_path / "m"), version=0, step=0)
    _beat(a, a_id, job_id, 7)  # no such version
    _beat(a, a_id, "job_0000000000000000", 0)  # holds a version of a job it is not on
    assert _versions(alice, job_id)[0]["workers_holding"] == 0


def test_version_list_is_owner_only(api, tmp_path):
    _, job_id, learner, _ = _job_with_two_workers(api, tmp_path)
    publish(learner, job_id, fake_model_folder(tmp_path / "m"), version=0, step=0)
    _, bob = new_user(api, name="bob")
    assert bob.get(f"/v1/jobs/{job_id}/versions").status_code == 404
