"""Proof of possession over HTTP: a version published with probes is leased only to a worker that hashed the
challenged range from its copy; a wrong answer is a strike; the probes never leave the control plane."""

import json

import pytest
from echo2.deltas import file_refs
from echo2.possession import answer
from echo2.protocol import Challenge
from echo2.snapshots import build_manifest

from api.models import WeightVersion
from tests.factories import (
    activate,
    fake_model_folder,
    new_job,
    new_provider,
    new_user,
    new_worker,
    ok,
    publish,
    running_job,
    start_learner,
)


@pytest.fixture
def setup(api, tmp_path):
    """A job whose version 0 was published with probes, and a worker active on it that holds nothing yet."""
    _, alice = new_user(api)
    job = new_job(alice)
    learner = start_learner(api, job["id"])
    folder = fake_model_folder(tmp_path / "m")
    publish(learner, job["id"], folder, version=0, step=0, probes=True)
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    return job, wid, worker, folder, alice


def beat(worker, wid, job, **body):
    return ok(worker.post(f"/v1/workers/{wid}/heartbeat", json={"job_id": job["id"], "versions_held": [0], **body}))


def lease(worker, job):
    return worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 2, "version": 0})


def proof_of(folder, challenge):
    """What an honest worker answers: the challenged bytes of its copy, hashed."""
    return answer(folder, file_refs(folder), Challenge.model_validate(challenge)).model_dump()


def test_a_claimed_version_is_challenged_and_leased_only_once_proven(api, setup):
    job, wid, worker, folder, _ = setup
    reply = beat(worker, wid, job)  # claims version 0 without having downloaded it
    [challenge] = reply["assignment"]["challenges"]
    assert challenge["version"] == 0 and challenge["length"] == 4096
    assert beat(worker, wid, job)["assignment"]["challenges"] == [challenge]  # a retry is asked the same
    r = lease(worker, job)
    assert r.status_code == 409 and r.json()["errors"][0]["field"] == "version"
    assert "not proven it holds version 0" in r.text and "assignment.challenges" in r.text
    [version] = ok(worker.get(f"/v1/jobs/{job['id']}/versions"))
    assert version["workers_holding"] == 0  # a claim is not a hold

    reply = beat(worker, wid, job, proofs=[proof_of(folder, challenge)])
    assert reply["assignment"]["challenges"] == []
    assert ok(lease(worker, job), 201)["version"] == 0
    [version] = ok(worker.get(f"/v1/jobs/{job['id']}/versions"))
    assert version["workers_holding"] == 1
    assert ok(api.admin.get(f"/v1/workers/{wid}"))["trust"] == "probation"


def test_a_wrong_answer_is_a_strike_and_the_version_stays_unproven(api, setup):
    job, wid, worker, folder, _ = setup
    [challenge] = beat(worker, wid, job)["assignment"]["challenges"]
    elsewhere = {**proof_of(folder, challenge), "offset": challenge["offset"] + 1}
    assert beat(worker, wid, job, proofs=[elsewhere])["assignment"]["challenges"] == [challenge]
    assert ok(api.admin.get(f"/v1/workers/{wid}"))["trust"] == "probation"  # answered no challenge: ignored

    wrong = {**challenge, "sha256": "0" * 64}
    reply = beat(worker, wid, job, proofs=[wrong])
    assert reply["assignment"]["challenges"] == [challenge]
    row = ok(api.admin.get(f"/v1/workers/{wid}"))
    assert row["trust"] == "suspect" and "claimed weights it does not hold" in row["trust_reason"]
    assert lease(worker, job).status_code == 409

    reply = beat(worker, wid, job, proofs=[wrong])  # a second lie: quarantined, and told so
    assert reply["assignment"] is None and reply["notice"].startswith("quarantined")
    assert ok(api.admin.get(f"/v1/workers/{wid}"))["trust"] == "quarantined"


def test_probes_are_checked_at_publication(api, tmp_path):
    _, alice = new_user(api)
    job = new_job(alice)
    learner = start_learner(api, job["id"])
    folder = fake_model_folder(tmp_path / "m")
    manifest = build_manifest(folder, 0, 0, 64 * 1024)
    probe = {"offset": manifest.total_size - 10, "length": 20, "sha256": "0" * 64}
    r = learner.post(f"/v1/jobs/{job['id']}/versions", json={"full": manifest.model_dump(mode="json"),
                                                            "probes": [probe]})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "probes[0]"
    assert "outside the version" in r.text
    r = learner.post(f"/v1/jobs/{job['id']}/versions", json={"full": manifest.model_dump(mode="json"),
                                                            "probes": [{**probe, "offset": 0}] * 65})
    assert r.status_code == 422


def test_probes_never_appear_in_a_response(api, setup):
    job, wid, worker, _, alice = setup
    with api.db.session() as s:
        secrets = [p["sha256"] for p in s.get(WeightVersion, (job["id"], 0)).probes]
    assert len(secrets) == 32
    base = f"/v1/jobs/{job['id']}"
    for client, path in [(alice, f"{base}/versions"), (worker, f"{base}/versions/0/manifest"),
                         (api.admin, f"{base}/versions"), (alice, base), (worker, f"/v1/workers/{wid}")]:
        r = client.get(path)
        text = r.text
        assert r.status_code == 200, text
        assert "probes" not in text and not any(s in text for s in secrets), path
    schema = ok(api.client().get("/openapi.json"))
    responses = json.dumps([op.get("responses") for path in schema["paths"].values() for op in path.values()])
    reachable = _reachable(schema, responses)
    assert "Probe" not in reachable and "VersionPublish" not in reachable
    assert not any("probes" in schema["components"]["schemas"][name].get("properties", {}) for name in reachable)


def _reachable(schema, text):
    """Every component schema a response refers to, directly or through others."""
    seen, todo = set(), [text]
    while todo:
        for ref in todo.pop().split('"#/components/schemas/')[1:]:
            name = ref.split('"')[0]
            if name not in seen:
                seen.add(name)
                todo.append(json.dumps(schema["components"]["schemas"][name]))
    return seen


def test_a_version_without_probes_is_held_when_claimed(api, tmp_path):
    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))  # published as before: no probes
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    assert beat(worker, wid, job)["assignment"]["challenges"] == []
    assert ok(lease(worker, job), 201)["version"] == 0
