import hashlib
import io
import json
import tarfile

import httpx
import pytest
from echo2.snapshots import build_manifest, iter_stream

from tests.factories import (
    SHA,
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

CHUNK = 64 * 1024


@pytest.fixture
def setup(api, tmp_path):
    _, alice = new_user(api)
    job = new_job(alice)
    learner = start_learner(api, job["id"])
    return job["id"], learner, alice, fake_model_folder(tmp_path / "m")


def upload(learner, jid, version, index, data, sha=None):
    return learner.put(f"/v1/jobs/{jid}/versions/{version}/chunks/{index}", content=data,
                       headers={SHA: sha or hashlib.sha256(data).hexdigest(),
                                "Content-Type": "application/octet-stream"})


def test_publish_then_download_chunks_with_range_and_hash(api, setup):
    jid, learner, alice, folder = setup
    version = publish(learner, jid, folder, version=0, step=0, chunk_size=CHUNK)
    assert version["num_chunks"] > 1 and version["publish_seconds"] is not None
    manifest = ok(alice.get(f"/v1/jobs/{jid}/versions/0/manifest"))
    chunk = alice.get(f"/v1/jobs/{jid}/versions/0/chunks/1")
    assert chunk.status_code == 200 and chunk.headers[SHA] == manifest["chunks"][1]["sha256"]
    assert hashlib.sha256(chunk.content).hexdigest() == manifest["chunks"][1]["sha256"]
    part = alice.get(f"/v1/jobs/{jid}/versions/0/chunks/1", headers={"Range": "bytes=100-199"})
    assert part.status_code == 206 and part.content == chunk.content[100:200]
    assert alice.get(f"/v1/jobs/{jid}/versions/0/chunks/999").status_code == 404
    assert [v["version"] for v in ok(alice.get(f"/v1/jobs/{jid}/versions"))] == [0]
    assert ok(alice.get(f"/v1/jobs/{jid}"))["version"] == 0


def test_checkpoint_tar_reproduces_the_folder(api, setup):
    jid, learner, alice, folder = setup
    publish(learner, jid, folder, version=0, step=0, chunk_size=CHUNK)
    r = alice.get(f"/v1/jobs/{jid}/checkpoint")
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        names = sorted(tar.getnames())
        assert names == sorted(p.name for p in folder.iterdir())
        for name in names:
            assert tar.extractfile(name).read() == (folder / name).read_bytes()


def test_corrupted_chunk_is_refused_and_never_announced(api, setup):
    jid, learner, alice, folder = setup
    manifest = build_manifest(folder, 0, 0, CHUNK)
    chunks = list(iter_stream(folder, manifest.files, CHUNK))
    tampered = b"\x00" + chunks[0][1:]
    r = upload(learner, jid, 0, 0, tampered, sha=manifest.chunks[0].sha256)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == SHA
    for info, data in zip(manifest.chunks[1:], chunks[1:], strict=True):
        assert upload(learner, jid, 0, info.index, data).status_code == 204
    r = learner.post(f"/v1/jobs/{jid}/versions", json={"full": manifest.model_dump(mode="json")})
    assert r.status_code == 422 and "chunk 0 was not uploaded" in r.json()["detail"]
    assert ok(alice.get(f"/v1/jobs/{jid}"))["version"] is None
    assert alice.get(f"/v1/jobs/{jid}/versions/0/manifest").status_code == 404


def test_manifest_that_disagrees_with_uploads_is_refused(api, setup):
    jid, learner, alice, folder = setup
    manifest = build_manifest(folder, 0, 0, CHUNK)
    for info, data in zip(manifest.chunks, iter_stream(folder, manifest.files, CHUNK), strict=True):
        upload(learner, jid, 0, info.index, data)
    lying = manifest.model_dump(mode="json")
    lying["chunks"][2]["sha256"] = "0" * 64
    r = learner.post(f"/v1/jobs/{jid}/versions", json={"full": lying})
    assert r.status_code == 422 and "chunk 2" in r.json()["detail"]
    inconsistent = manifest.model_dump(mode="json")
    inconsistent["total_size"] += 1
    assert learner.post(f"/v1/jobs/{jid}/versions", json={"full": inconsistent}).status_code == 422
    assert ok(alice.get(f"/v1/jobs/{jid}"))["version"] is None


def test_versions_must_increase(api, setup):
    jid, learner, _, folder = setup
    publish(learner, jid, folder, version=1, step=1, chunk_size=CHUNK)
    r = upload(learner, jid, 1, 0, b"data")
    assert r.status_code == 409 and r.json()["errors"][0]["field"] == "version"
    manifest = build_manifest(folder, 0, 0, CHUNK)
    assert learner.post(f"/v1/jobs/{jid}/versions", json={"full": manifest.model_dump(mode="json")}).status_code == 409


def test_chunk_access_is_limited_to_the_jobs_parties(api, setup):
    jid, learner, alice, folder = setup
    publish(learner, jid, folder, version=0, step=0, chunk_size=CHUNK)
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    assert worker.get(f"/v1/jobs/{jid}/versions/0/manifest").status_code == 404
    activate(api, wid, jid)
    assert worker.get(f"/v1/jobs/{jid}/versions/0/manifest").status_code == 200
    assert worker.get(f"/v1/jobs/{jid}/versions/0/chunks/0").status_code == 200
    assert worker.get(f"/v1/jobs/{jid}/checkpoint").status_code == 404
    _, bob = new_user(api, "bob")
    assert bob.get(f"/v1/jobs/{jid}/versions/0/chunks/0").status_code == 404
    assert bob.get(f"/v1/jobs/{jid}/checkpoint").status_code == 404
    assert alice.put(f"/v1/jobs/{jid}/versions/1/chunks/0", content=b"x",
                     headers={SHA: hashlib.sha256(b"x").hexdigest()}).status_code == 403


def test_chunk_upload_size_limit(api, setup):
    jid, learner, _, _ = setup
    big = b"x" * (api.server.settings.max_chunk_bytes + 1)
    assert upload(learner, jid, 0, 0, big).status_code == 413


def test_manifest_paths_cannot_escape_the_folder(api, setup):
    jid, learner, _, folder = setup
    manifest = build_manifest(folder, 0, 0, CHUNK).model_dump(mode="json")
    for bad in ("../evil.safetensors", "/etc/passwd", "a//b"):
        manifest["files"][0]["path"] = bad
        r = learner.post(f"/v1/jobs/{jid}/versions", json={"full": manifest})
        assert r.status_code == 422 and "full.files.0.path" in r.json()["errors"][0]["field"]


def _over_default(api) -> int:
    return api.server.settings.max_body_bytes + 2**20  # past the 16 MiB default, far below the 64 MiB chunk limit


def test_a_dataset_part_put_to_an_upload_named_chunks_is_held_to_the_default_limit(api):
    """The 64 MiB chunk limit went to any PUT whose path held "/chunks/", a path its caller writes: naming an id
    "chunks" gave any PUT route 4x the body limit, read before its token was checked (review finding)."""
    _, alice = new_user(api)
    body = b"x" * _over_default(api)
    r = alice.put("/v1/datasets/uploads/chunks/parts/0", content=body,
                  headers={"Content-Type": "application/octet-stream", "X-Echo2-Sha256": "0" * 64})
    assert r.status_code == 413, (r.status_code, r.text[:200])


def test_a_json_route_with_a_segment_named_chunks_is_held_to_the_default_limit_before_authentication(api):
    # PUT /v1/users/{user_id}/quotas with user_id "chunks": no token at all; FastAPI reads and parses the body
    # before it resolves the admin dependency, so the API buffers and json-parses up to 64 MiB for anyone.
    pad = "0," * (_over_default(api) // 2)
    body = ('{"max_concurrent_jobs": 1, "pad": [' + pad + '0]}').encode()
    with httpx.Client(base_url=api.server.url, timeout=60) as anonymous:
        r = anonymous.put("/v1/users/chunks/quotas", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 413, (r.status_code, r.text[:200])


def test_a_tinker_ttl_put_with_segment_chunks_is_held_to_the_default_limit(api):
    _, alice = new_user(api)
    body = json.dumps({"ttl_seconds": 3600, "pad": "x" * _over_default(api)}).encode()
    r = alice.put("/api/v1/training_runs/run/checkpoints/chunks/name/ttl", content=body,
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 413, (r.status_code, r.text[:200])


def test_every_chunk_route_keeps_the_chunk_limit_and_no_other_path_gets_it():
    """A Tinker host's state chunks are 32 MiB (learner/tinker/host.py): the first whole-path rule left their route
    out, and a real state over 16 MiB could no longer be saved (review finding)."""
    from api.app import CHUNK_PUTS

    for path in ("/v1/jobs/job_1/versions/3/chunks/0", "/v1/jobs/job_1/versions/3/delta/chunks/12",
                 "/v1/jobs/job_1/learner/checkpoints/40/chunks/2", f"/v1/tinker/host/states/{'ab' * 32}/chunks/1"):
        assert CHUNK_PUTS.fullmatch(path), path
    for path in ("/v1/users/chunks/quotas", "/v1/datasets/uploads/chunks/parts/0",
                 "/api/v1/training_runs/x/checkpoints/chunks/n/ttl", "/v1/tinker/host/states/x/chunks/1/extra"):
        assert not CHUNK_PUTS.fullmatch(path), path
