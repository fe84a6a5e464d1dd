"""Every resource method of `AsyncClient`, against the real control plane (driven by asyncio.run)."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest
from echo2 import AsyncClient, ConfigurationError, ConflictError, GoneError, NotFoundError, WaitTimeoutError
from echo2.protocol import JobRead, JobStatus, RolloutStatus, StepMetrics

from tests.conftest import ADMIN_KEY
from tests.factories import new_worker

from .conftest import SPEC, long_job


def test_async_configuration(api, monkeypatch):
    monkeypatch.delenv("ECHO2_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="ECHO2_API_KEY"):
        AsyncClient(api.url)
    monkeypatch.setenv("ECHO2_API_KEY", ADMIN_KEY)

    async def main() -> None:
        async with AsyncClient(api.url) as client:
            assert (await client.users.me()).role == "admin"

    asyncio.run(main())


def test_async_users_and_providers(api):
    async def main() -> None:
        async with AsyncClient(api.url, ADMIN_KEY) as admin:
            created = await admin.users.create("carol")
            assert created.user.name == "carol"
            assert "carol" in [u.name for u in await admin.users.list()]
            key = await admin.users.create_key(created.user.id)
            async with AsyncClient(api.url, key.api_key) as carol:
                assert (await carol.users.me()).id == created.user.id
            provider = await admin.providers.create("async-gpu")
            assert provider.provider.id in {p.id for p in await admin.providers.list()}
            new_worker(api, api.client(provider.token))
            async with AsyncClient(api.url, provider.token) as as_provider:
                assert (await as_provider.providers.me()).num_workers == 1
                assert (await as_provider.workers.list()).total == 1

    asyncio.run(main())


def test_async_jobs(alice, api):
    async def main() -> None:
        async with AsyncClient(api.url, alice.key) as client:
            job = await client.jobs.create(SPEC, idempotency_key="k1")
            again = await client.jobs.create(SPEC, idempotency_key="k1")
            assert isinstance(job, JobRead) and again.id == job.id
            other = await client.jobs.create(name="other", base_model="echo2:tiny", task="arithmetic",
                                             num_prompts=16)
            assert (await client.jobs.get(job.id)).id == job.id
            page = await client.jobs.list(limit=1)
            assert page.total == 2 and page.items[0].id == other.id and page.next_offset == 1
            assert (await client.jobs.list(name="other")).total == 1
            assert (await client.jobs.list(status="cancelled")).total == 0
            prompts = await client.jobs.prompts(job.id, limit=3, offset=9)
            assert [p.index for p in prompts.items] == [9, 10, 11] and prompts.next_offset is None
            with pytest.raises(WaitTimeoutError):
                await client.jobs.wait(job.id, timeout=0.2, poll_interval=0.05)
            cancelled = await client.jobs.cancel(job.id)
            assert cancelled.status == JobStatus.cancelled
            with pytest.raises(ConflictError):
                await client.jobs.cancel(job.id)
            assert (await client.jobs.wait(job.id)).status == JobStatus.cancelled
            seen = [j.status async for j in client.jobs.follow(job.id)]
            assert seen == [JobStatus.cancelled]

    asyncio.run(main())


def test_async_rollouts_metrics_workers_checkpoints(alice, api, driven, tmp_path):
    async def main() -> None:
        async with AsyncClient(api.url, alice.key) as client:
            rollouts = await client.jobs.rollouts(driven.id, status=RolloutStatus.trained)
            assert {r.id for r in rollouts.items} == set(driven.rollout_ids)
            metrics = await client.jobs.metrics(driven.id, since_step=0)
            assert [type(m) for m in metrics] == [StepMetrics] and metrics[0].groups == 2
            workers = await client.workers.list(job_id=driven.id)
            assert [w.id for w in workers.items] == [driven.worker_id]
            assert (await client.workers.get(driven.worker_id)).id == driven.worker_id
            assert [v.version for v in await client.checkpoints.versions(driven.id)] == [0, 1]
            manifest = await client.checkpoints.manifest(driven.id, 0)
            assert manifest.version == 0
            old = await client.checkpoints.download(driven.id, tmp_path / "v0", version=0)
            assert _digests(old) == _digests(driven.folder)
            follow = client.jobs.follow(driven.id, poll_interval=0.05, timeout=30)
            first = await follow.__anext__()
            assert first.status == JobStatus.running
            driven.finish()
            rest = [j async for j in follow]
            assert rest[-1].status == JobStatus.succeeded
            dest = await client.checkpoints.download(driven.id, tmp_path / "ckpt")
            assert _digests(dest) == _digests(driven.folder)
            with pytest.raises(GoneError):  # finished: only the final checkpoint is kept
                await client.checkpoints.download(driven.id, tmp_path / "v0-later", version=0)

    asyncio.run(main())


def test_async_datasets_and_tasks(alice, api, tmp_path):
    async def main() -> None:
        async with AsyncClient(api.url, alice.key) as client:
            items = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "#### 4"}]
            ds = await client.datasets.create("pairs", items)
            path = tmp_path / "d.jsonl"
            path.write_text("".join(json.dumps(i) + "\n" for i in items))
            up = await client.datasets.upload("uploaded", path)
            assert up.num_items == 2
            assert (await client.datasets.list()).total == 2
            assert (await client.datasets.get(ds.id)).name == "pairs"
            assert (await client.datasets.items(ds.id, limit=1)).items == items[:1]
            await client.datasets.delete(ds.id)
            with pytest.raises(NotFoundError):
                await client.datasets.items(ds.id)
            tasks = await client.tasks.list()
            assert "arithmetic" in {t.name for t in tasks}

    asyncio.run(main())


def _digests(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file()}


def test_async_metrics_returns_every_step(api, alice):
    jid = long_job(api, alice, 1200)

    async def main() -> None:
        async with AsyncClient(api.url, alice.key) as client:
            assert [m.step for m in await client.jobs.metrics(jid)] == list(range(1200))
            assert [m.step for m in await client.jobs.metrics(jid, since_step=10, limit=5)] == list(range(10, 15))

    asyncio.run(main())
