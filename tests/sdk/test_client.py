"""Every resource method of the synchronous `Client`, against the real control plane."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import pytest
from echo2 import Client, ConfigurationError, GoneError, NotFoundError, WaitTimeoutError
from echo2.client import every
from echo2.protocol import (
    DatasetRead,
    JobRead,
    JobSpec,
    JobStatus,
    Page,
    RolloutStatus,
    StepMetrics,
    TaskInfo,
    UserRead,
)

from tests.conftest import ADMIN_KEY
from tests.factories import activate, new_provider, new_worker

from .conftest import SPEC, long_job


def test_configuration_from_arguments_or_environment(api, monkeypatch):
    monkeypatch.delenv("ECHO2_BASE_URL", raising=False)
    monkeypatch.delenv("ECHO2_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="ECHO2_BASE_URL"):
        Client(api_key="k")
    with pytest.raises(ConfigurationError, match="ECHO2_API_KEY"):
        Client(api.url)
    with pytest.raises(ConfigurationError, match="not an http"):
        Client("localhost:8000", "k")
    monkeypatch.setenv("ECHO2_BASE_URL", api.url + "/")
    monkeypatch.setenv("ECHO2_API_KEY", ADMIN_KEY)
    with Client() as client:
        assert client.base_url == api.url and ADMIN_KEY not in repr(client)
        assert client.users.me().role == "admin"


def test_users(api, admin, alice):
    me = alice.client.users.me()
    assert isinstance(me, UserRead) and me.id == alice.id and me.name == "alice" and me.role == "user"
    names = [u.name for u in admin.users.list()]
    assert "alice" in names
    key = alice.client.users.create_key(alice.id)
    assert key.api_key.startswith("e2u_") and key.token.principal_id == alice.id
    with Client(api.url, key.api_key) as again:
        assert again.users.me().id == alice.id
    assert key.token.id in {k.id for k in alice.client.users.list_keys(alice.id)}
    alice.client.users.revoke_key(key.token.id)  # rotated: the old key retired
    assert key.token.id not in {k.id for k in alice.client.users.list_keys(alice.id)}
    bob = admin.users.create("bob", role="admin")
    assert bob.user.role == "admin"


def test_create_get_list_jobs(alice):
    jobs = alice.client.jobs
    first = jobs.create(SPEC)
    assert isinstance(first, JobRead) and first.status == JobStatus.queued and first.num_prompts == 12
    # keyword fields, with the short task form, override a JobSpec
    second = jobs.create(JobSpec.model_validate(SPEC), name="second", task="arithmetic", max_steps=4)
    assert second.spec.name == "second" and second.spec.max_steps == 4
    assert second.spec.task.name == "arithmetic"
    assert jobs.get(first.id) == first
    page = jobs.list(limit=1)
    assert isinstance(page, Page) and page.total == 2 and page.next_offset == 1
    assert page.items[0].id == second.id
    assert [j.id for j in jobs.list(offset=1).items] == [first.id]
    assert [j.id for j in every(lambda o: jobs.list(limit=1, offset=o))] == [second.id, first.id]
    assert jobs.list(name="secon").total == 1
    assert jobs.list(status="running").total == 0 and jobs.list(status=JobStatus.queued).total == 2


def test_idempotency_key_replays_the_same_job(alice):
    a = alice.client.jobs.create(SPEC, idempotency_key="same-key")
    b = alice.client.jobs.create(SPEC, idempotency_key="same-key")
    c = alice.client.jobs.create(SPEC)
    assert a.id == b.id != c.id
    assert alice.client.jobs.list().total == 2


def test_cancel_and_prompts(alice):
    job = alice.client.jobs.create(SPEC)
    prompts = alice.client.jobs.prompts(job.id, limit=5)
    assert prompts.total == 12 and len(prompts.items) == 5 and prompts.next_offset == 5
    assert [p.index for p in alice.client.jobs.prompts(job.id, offset=10).items] == [10, 11]
    cancelled = alice.client.jobs.cancel(job.id)
    assert cancelled.status == JobStatus.cancelled and cancelled.finished_at is not None
    assert "alice" in (cancelled.status_reason or "")


def test_rollouts_metrics_and_workers(alice, driven):
    jobs = alice.client.jobs
    rollouts = jobs.rollouts(driven.id)
    assert rollouts.total == 2 and {r.id for r in rollouts.items} == set(driven.rollout_ids)
    assert jobs.rollouts(driven.id, status=RolloutStatus.trained).total == 2
    assert jobs.rollouts(driven.id, status="rejected").total == 0
    # completions are the platform's decoding of the tokens (tests/api/test_admission.py); this fake model
    # folder has no tokenizer, so they say so
    assert rollouts.items[0].rewards == [1.0, 0.0] and len(rollouts.items[0].completions) == 2
    metrics = jobs.metrics(driven.id)
    assert [type(m) for m in metrics] == [StepMetrics] and metrics[0].step == 0
    assert metrics[0].reward_mean == 0.5 and metrics[0].staleness_hist == [1, 1]
    assert jobs.metrics(driven.id, since_step=1) == []
    job = jobs.get(driven.id)
    assert job.step == 1 and job.version == 1 and job.reward_mean == 0.5
    workers = alice.client.workers.list()
    assert [w.id for w in workers.items] == [driven.worker_id]
    assert alice.client.workers.list(job_id=driven.id).total == 1
    assert alice.client.workers.list(status="deregistered").total == 0
    assert alice.client.workers.get(driven.worker_id).job_id == driven.id


def test_wait_and_follow(alice, driven):
    jobs = alice.client.jobs
    with pytest.raises(WaitTimeoutError, match="still running"):
        jobs.wait(driven.id, timeout=0.3, poll_interval=0.1)
    threading.Timer(0.5, driven.finish).start()
    seen = list(jobs.follow(driven.id, poll_interval=0.1, timeout=30))
    assert seen[0].status == JobStatus.running and seen[-1].status == JobStatus.succeeded
    assert len(seen) == len({s.model_dump_json() for s in seen})  # only changes are yielded
    started = time.monotonic()
    assert jobs.wait(driven.id).status == JobStatus.succeeded
    assert time.monotonic() - started < 1  # already terminal: no polling


def test_datasets(alice, tmp_path):
    datasets = alice.client.datasets
    items = [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"} for i in range(5)]
    ds = datasets.create("sums", items)
    assert isinstance(ds, DatasetRead) and ds.num_items == 5 and ds.keys == ["answer", "question"]
    path = tmp_path / "more.jsonl"
    path.write_text("\n".join(json.dumps(i) for i in items[:3]) + "\n")
    up = datasets.upload("more", path)
    assert up.num_items == 3 and up.name == "more"
    assert {d.id for d in datasets.list().items} == {ds.id, up.id}
    assert datasets.list(limit=1).next_offset == 1
    assert datasets.get(ds.id) == ds
    page = datasets.items(ds.id, limit=2, offset=1)
    assert page.items == items[1:3] and page.total == 5 and page.next_offset == 3
    job = alice.client.jobs.create(SPEC, task={"name": "gsm8k"}, dataset_id=ds.id, num_prompts=None)
    assert job.num_prompts == 5
    assert datasets.delete(up.id) is None
    with pytest.raises(NotFoundError):
        datasets.get(up.id)


def test_tasks(alice):
    tasks = alice.client.tasks.list()
    assert all(isinstance(t, TaskInfo) for t in tasks)
    arithmetic = next(t for t in tasks if t.name == "arithmetic")
    assert arithmetic.needs_dataset is False and arithmetic.params_schema["type"] == "object"


def test_providers(api, admin):
    created = admin.providers.create("gpu-co", contact="ops@example.com")
    assert created.token.startswith("e2p_") and created.provider.num_workers == 0
    new_worker(api, api.client(created.token))
    left, worker = new_worker(api, api.client(created.token))
    assert worker.delete(f"/v1/workers/{left}").status_code == 204
    with Client(api.url, created.token) as provider:
        me = provider.providers.me()
        assert me.id == created.provider.id and me.num_workers == 1
        assert provider.workers.list().total == 2
        assert provider.workers.list(include_deregistered=False).total == 1
    assert created.provider.id in {p.id for p in admin.providers.list()}


def test_workers_are_only_visible_on_your_jobs(api, alice, admin):
    _, provider = new_provider(api)
    wid, _ = new_worker(api, provider)
    assert alice.client.workers.list().total == 0
    with pytest.raises(NotFoundError):
        alice.client.workers.get(wid)
    job = alice.client.jobs.create(SPEC)
    activate(api, wid, job.id)
    assert alice.client.workers.get(wid).desired == "active"
    assert admin.workers.list().total == 1


def test_checkpoint_download_matches_the_published_folder(alice, driven, tmp_path):
    ckpt = alice.client.checkpoints
    assert [v.version for v in ckpt.versions(driven.id)] == [0, 1]
    manifest = ckpt.manifest(driven.id, 1)
    assert {f.path for f in manifest.files} == {"config.json", "model.safetensors"}
    latest = ckpt.download(driven.id, tmp_path / "latest")
    _assert_same_folder(driven.folder, latest)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ckpt.download(driven.id, empty, version=0) == empty  # still stored: the job runs
    _assert_same_folder(driven.folder, empty)
    driven.finish()
    final = ckpt.download(driven.id, tmp_path / "final")
    _assert_same_folder(driven.folder, final)
    with pytest.raises(GoneError, match="deleted"):  # only the final checkpoint is kept once finished
        ckpt.download(driven.id, tmp_path / "v0", version=0)
    assert [v.available for v in ckpt.versions(driven.id)] == [False, True]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_checkpoint_download_refuses_a_non_empty_folder(alice, driven, tmp_path):
    from echo2 import CheckpointError

    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        alice.client.checkpoints.download(driven.id, dest)
    assert (dest / "keep.txt").read_text() == "mine"
    alice.client.checkpoints.download(driven.id, dest, overwrite=True)
    assert not (dest / "keep.txt").exists()
    _assert_same_folder(driven.folder, dest)


def test_checkpoint_of_a_job_without_versions_is_not_found(alice, tmp_path):
    job = alice.client.jobs.create(SPEC)
    with pytest.raises(NotFoundError, match="no published version"):
        alice.client.checkpoints.download(job.id, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def _assert_same_folder(expected, got):
    def digests(root):
        return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in root.rglob("*") if p.is_file()}

    assert digests(got) == digests(expected)


def test_metrics_returns_every_step_from_since_step_on(api, alice):
    """GET /v1/jobs/{id}/metrics answers at most a page of steps (1,000 by default); `jobs.metrics()` promises
    every step from `since_step` on, so a 1,200-step job's must not end at step 999."""
    jid = long_job(api, alice, 1200)
    rows = alice.client.jobs.metrics(jid)
    assert [m.step for m in rows] == list(range(1200)), (
        f"jobs.metrics() promises the metrics from since_step on; it returned {len(rows)} of 1200 steps "
        f"(the last {rows[-1].step})")
    assert [m.step for m in alice.client.jobs.metrics(jid, since_step=150, limit=1001)] == list(range(150, 1151))
    assert [m.step for m in alice.client.jobs.metrics(jid, since_step=1199)] == [1199]
