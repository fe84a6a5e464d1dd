"""Weight retention: versions nothing can use any more are deleted; kept ones stay downloadable."""

import asyncio
import io
import os
import shutil
import tarfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from api.models import utcnow
from api.services import retention
from api.storage import PIN_MAX_AGE_S, PINS, BlobStore
from tests.factories import fake_model_folder, new_user, ok, publish, run_tick, running_job, step_report


def _train(api, tmp_path, steps: int, staleness: int = 1, **overrides):
    _, alice = new_user(api)
    folder = fake_model_folder(tmp_path / "m")
    job, learner = running_job(api, alice, folder, staleness=staleness, **{"max_steps": 20, **overrides})
    for step in range(steps):
        ok(learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(step, [])))
        publish(learner, job["id"], folder, version=step + 1, step=step + 1)
    return alice, job["id"], learner


def _available(user, job_id: str) -> dict[int, bool]:
    return {v["version"]: v["available"] for v in ok(user.get(f"/v1/jobs/{job_id}/versions"))}


def _version_dirs(api, job_id: str) -> set[str]:
    return {p.name for p in (api.server.settings.blob_dir / job_id).iterdir()}


def test_only_admissible_versions_are_kept_while_running(api, tmp_path):
    alice, job_id, _ = _train(api, tmp_path, steps=5, staleness=1)
    # step 5 now; with S = 1 rollouts of versions 4 and 5 are still admissible
    assert _available(alice, job_id) == {0: False, 1: False, 2: False, 3: False, 4: True, 5: True}
    assert _version_dirs(api, job_id) == {"v4", "v5"}
    r = alice.get(f"/v1/jobs/{job_id}/versions/2/manifest")
    assert r.status_code == 410 and "deleted" in r.json()["detail"]
    assert alice.get(f"/v1/jobs/{job_id}/versions/2/chunks/0").status_code == 410
    assert alice.get(f"/v1/jobs/{job_id}/checkpoint", params={"version": 2}).status_code == 410
    assert alice.get(f"/v1/jobs/{job_id}/checkpoint", params={"version": 5}).status_code == 200


def test_finishing_keeps_only_the_final_checkpoint(api, tmp_path):
    alice, job_id, learner = _train(api, tmp_path, steps=4)
    ok(learner.post(f"/v1/jobs/{job_id}/learner/finish", json={"outcome": "succeeded", "final_version": 3}))
    assert [v for v, kept in _available(alice, job_id).items() if kept] == [3]
    assert _version_dirs(api, job_id) == {"v3"}
    r = alice.get(f"/v1/jobs/{job_id}/checkpoint")
    assert r.status_code == 200 and r.headers["X-Echo2-Version"] == "3"


def test_cancelling_keeps_the_newest(api, tmp_path):
    alice, job_id, _ = _train(api, tmp_path, steps=3)
    ok(alice.post(f"/v1/jobs/{job_id}/cancel"))
    assert [v for v, kept in _available(alice, job_id).items() if kept] == [3]


@pytest.fixture
def keep_every_two(api):
    api.server.settings.keep_versions_every = 2
    yield
    api.server.settings.keep_versions_every = 0


def test_keep_every_n_keeps_intermediate_checkpoints(api, tmp_path, keep_every_two):
    alice, job_id, learner = _train(api, tmp_path, steps=5, staleness=0)
    ok(learner.post(f"/v1/jobs/{job_id}/learner/finish", json={"outcome": "succeeded", "final_version": 5}))
    assert [v for v, kept in _available(alice, job_id).items() if kept] == [0, 2, 4, 5]


def test_sweep_collects_what_the_routes_did_not(api, tmp_path):
    alice, job_id, _ = _train(api, tmp_path, steps=3, staleness=2, max_steps=3)
    silent = utcnow() + timedelta(seconds=api.server.settings.learner_dead_after_s + 1)
    run_tick(api, now=silent)  # the learner died after its last step: the scheduler closes the job
    assert api.admin.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"
    assert _version_dirs(api, job_id) == {"v1", "v2", "v3"}  # the scheduler cannot reach the blobs
    blobs = api.server.app.state.blobs
    shutil.copytree(blobs.root / job_id / "v3", blobs.root / job_id / "v4.staging")  # never published
    _, running_id, _ = _train(api, tmp_path / "other", steps=1)
    (blobs.root / running_id / "v2.staging").mkdir()  # a running job's upload in progress

    with api.db.session() as s:
        assert retention.sweep(s, blobs, every=0) == 2
    assert [v for v, kept in _available(alice, job_id).items() if kept] == [3]
    assert _version_dirs(api, job_id) == {"v3"}
    assert _version_dirs(api, running_id) == {"v0", "v1", "v2.staging"}

    shutil.copytree(blobs.root / job_id / "v3", blobs.root / job_id / "v1")  # a crash after the commit
    shutil.copytree(blobs.root / job_id / "v3", blobs.root / job_id / "c3")  # a learner checkpoint it left
    asyncio.run(retention.sweep_periodically(api.db, blobs, api.server.app.state.checkpoints,
                                             api.server.settings.model_copy(update={"retention_sweep_s": 0})))
    assert _version_dirs(api, job_id) == {"v3"} and not (blobs.root / job_id / "c3").exists()
    assert alice.get(f"/v1/jobs/{job_id}/checkpoint").status_code == 200


CHUNK = 4 * 2**20


def _big_model(root: Path) -> Path:
    """A model folder of ~24 MB: larger than what the loopback socket buffers hold, as any real model is."""
    import numpy as np
    from safetensors.numpy import save_file

    root.mkdir(parents=True)
    save_file({"w": np.random.default_rng(0).standard_normal((2048, 3072)).astype("float32")},
              str(root / "model.safetensors"))
    (root / "config.json").write_text('{"model_type": "test"}')
    return root


def test_downloading_a_running_jobs_newest_checkpoint_survives_the_next_publications(api, tmp_path):
    """`echo2 checkpoints download JOB` on a running job streams its newest version (docs/RELIABILITY.md: supported
    mid-training). With staleness 1 that version is collected two publications later, and the tar stream read
    each chunk file only when it got to it: a download of a real model (minutes) while the learner publishes
    (every step) lost its files mid-stream and the user got a truncated tar. It streams from a pinned copy now,
    removed when the download ends."""
    _, alice = new_user(api)
    folder = _big_model(tmp_path / "m0")
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "tiny"), staleness=1, max_steps=20)
    jid = job["id"]
    # version 0 is the tiny folder (running_job); the learner's step 0 publishes the real-size version 1
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(0, [])))
    publish(learner, jid, folder, version=1, step=1, chunk_size=CHUNK)

    body = bytearray()
    with httpx.Client(base_url=api.url, headers=alice.headers, timeout=60) as c, \
            c.stream("GET", f"/v1/jobs/{jid}/checkpoint") as r:
        assert r.status_code == 200 and r.headers["X-Echo2-Version"] == "1"
        stream = r.iter_bytes()
        while len(body) < 1 << 16:
            body += next(stream)
        # the learner goes on meanwhile: two more steps, each publishing (a small version is enough)
        for step in (1, 2):
            ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(step, [])))
            publish(learner, jid, fake_model_folder(tmp_path / f"m{step + 1}", seed=step), version=step + 1,
                    step=step + 1)
        try:
            for piece in stream:
                body += piece
        except httpx.HTTPError as exc:
            raise AssertionError(f"the download broke after {len(body)} bytes: {exc!r}") from exc
    with tarfile.open(fileobj=io.BytesIO(bytes(body))) as tar:
        got = tar.extractfile("model.safetensors").read()  # type: ignore[union-attr]
    assert got == (folder / "model.safetensors").read_bytes()
    pins = Path(api.server.settings.blob_dir) / PINS
    deadline = time.monotonic() + 10  # released once the server's response is done, just after the last byte
    while any(pins.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pins.iterdir()), "the pinned copy outlived its download"
    assert _available(alice, jid)[1] is False  # retention did collect the version meanwhile


def test_a_pin_left_by_a_process_that_died_mid_download_is_swept(tmp_path):
    blobs = BlobStore(tmp_path / "blobs")
    old, fresh = (blobs.root / PINS / name for name in ("old", "fresh"))
    for pin in (old, fresh):
        (pin / "job_x" / "v1").mkdir(parents=True)
    os.utime(old, (time.time() - PIN_MAX_AGE_S - 60,) * 2)
    blobs.drop_stale_pins()
    assert not old.exists() and fresh.exists()
    assert list(blobs.stored()) == []  # a pin is no version of a job called .pins


def test_a_download_the_client_abandons_leaves_no_pinned_copy(api, tmp_path):
    """A user who stops `echo2 checkpoints download` (Ctrl-C, a dropped connection) part-way: the pinned copy of
    the version must go with the stream, or every abandoned download keeps a whole model's blocks on disk for
    a day (PIN_MAX_AGE_S) after retention deleted the version. A generator's `finally` ran only when the garbage
    collector got to it (Starlette leaves an abandoned download's iterator unclosed): api/files.ReleasingStream."""
    _, alice = new_user(api)
    job, learner = running_job(api, alice, fake_model_folder(tmp_path / "tiny"), staleness=1, max_steps=20)
    jid = job["id"]
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=step_report(0, [])))
    publish(learner, jid, _big_model(tmp_path / "m0"), version=1, step=1, chunk_size=CHUNK)
    pins = Path(api.server.settings.blob_dir) / PINS
    with httpx.Client(base_url=api.url, headers=alice.headers, timeout=60) as c, \
            c.stream("GET", f"/v1/jobs/{jid}/checkpoint") as r:
        assert r.status_code == 200
        next(r.iter_bytes())
        assert any(pins.iterdir())
    # the client is gone; the server notices at its next write
    deadline = time.monotonic() + 20
    while any(pins.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p.name for p in pins.iterdir()]
    assert not left, f"an abandoned download left its pinned copy behind: {left}"


def test_sweeping_stale_pins_survives_a_download_ending_meanwhile(tmp_path):
    """drop_stale_pins (run by every retention pass) lists .pins, then stat()s each entry: a download that
    ended between the two made the stat raise FileNotFoundError and the whole retention pass fail."""
    blobs = BlobStore(tmp_path / "blobs")
    (blobs.root / PINS).mkdir()
    stop, errors = threading.Event(), []

    def downloads() -> None:
        while not stop.is_set():
            for i in range(50):
                (blobs.root / PINS / f"p{i}" / "job" / "v1").mkdir(parents=True, exist_ok=True)
            for i in range(50):
                shutil.rmtree(blobs.root / PINS / f"p{i}", ignore_errors=True)

    t = threading.Thread(target=downloads, daemon=True)
    t.start()
    try:
        for _ in range(3000):
            try:
                blobs.drop_stale_pins()
            except FileNotFoundError as exc:
                errors.append(exc)
                break
    finally:
        stop.set()
        t.join()
    assert not errors, f"a retention pass failed on a pin removed while it looked: {errors[0]!r}"


def test_a_version_that_cannot_be_hard_linked_is_read_unpinned_and_leaves_no_copy(tmp_path, monkeypatch):
    """A blob root on a filesystem without hard links, or a job folder on another device (os.link: EXDEV, EPERM,
    ENOTSUP): the version is read where it is, as before there were pins, and no half-made copy stays."""
    import errno
    import os

    from echo2.protocol import Form, Manifest

    blobs = BlobStore(tmp_path / "blobs")
    folder = blobs.root / "job_x" / "v1"
    folder.mkdir(parents=True)
    (folder / "0.chunk").write_bytes(b"x")
    manifest = Manifest.model_construct(version=1, form=Form.full)

    def no_links(src, dst, *a, **k):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    store, release = blobs.pin("job_x", manifest)
    release()
    assert store is blobs and (folder / "0.chunk").exists()  # releasing it deletes nothing of the version
    left = list((blobs.root / PINS).iterdir())
    assert not left, f"a pin that failed to link left {left} behind"


def test_an_ended_lora_jobs_kept_base_does_not_bring_it_back_to_every_sweep(api, tmp_path):
    """The base model a LoRA job's final adapter applies to is kept, but is not the final version: the ended
    job matched the sweep's query on every pass for good (work that grows with every ended LoRA job)."""
    from api.models import WeightVersion

    _, job_id, _ = _train(api, tmp_path, steps=3, staleness=2, max_steps=3)
    run_tick(api, now=utcnow() + timedelta(seconds=api.server.settings.learner_dead_after_s + 1))
    with api.db.session() as s:
        s.get(WeightVersion, (job_id, 3)).adapter_base = 2  # its final adapter applies to version 2
        s.commit()
        assert retention.sweep(s, api.server.app.state.blobs, every=0) == 1  # v1 goes, the base stays
        assert _version_dirs(api, job_id) == {"v2", "v3"}
        assert job_id not in s.scalars(retention._ended_with_extra_versions(0)).all()
