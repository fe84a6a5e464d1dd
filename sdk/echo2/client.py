"""`Client` and `AsyncClient`: the Echo2 REST API as typed resources, shaped like openai-python.

    with echo2.Client() as client:            # ECHO2_BASE_URL / ECHO2_API_KEY
        job = client.jobs.create(name="demo", base_model="echo2:tiny", task="arithmetic", max_steps=20)
        job = client.jobs.wait(job.id)
        client.checkpoints.download(job.id, "out/")

Every method returns protocol models (never raw dicts) and raises the classes of `echo2.errors`.
Requests go through `echo2.transport`: retried with exponential backoff and jitter on connection errors,
429, 503 and 409-with-Retry-After, honouring Retry-After; a job create carries one Idempotency-Key
across its retries, so a retried submit can never create two jobs. Each method is written once, as the
request it sends (`@endpoint`); `Client` and `AsyncClient` differ only in how they send it, and only
methods that do more than one request (follow, wait, download) are written twice.
"""

from __future__ import annotations

import builtins
import hashlib
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import httpx

from . import __version__, dataset_files, errors
from ._resource import AsyncResource, Resource, SyncResource, endpoint, json_body, parse, query, seg, validated
from .protocol import (
    ApiKeyCreated,
    AuditRead,
    DatasetCreate,
    DatasetItems,
    DatasetRead,
    DecisionRead,
    EvalRead,
    JobEstimate,
    JobLedger,
    JobRead,
    JobReport,
    JobSpec,
    JobStatus,
    JobUpdate,
    Manifest,
    Page,
    PromptRead,
    ProviderCreate,
    ProviderCreated,
    ProviderRead,
    ProviderStatement,
    Quotas,
    Role,
    RolloutRead,
    RolloutStatus,
    RolloutTrace,
    StepMetrics,
    TaskInfo,
    TokenRead,
    UploadCreate,
    UploadRead,
    UserCreate,
    UserCreated,
    UserRead,
    VersionRead,
    WorkerRead,
    WorkerStatus,
)
from .protocol.tinker import TinkerUsage
from .transport import DEFAULT_TIMEOUT, AsyncTransport, Call, RetryPolicy, Transport, connection_error
from .untar import Staging, TarSink, check_dest

__all__ = ["Client", "AsyncClient", "DEFAULT_TIMEOUT", "DEFAULT_MAX_RETRIES", "push_to_hub", "every"]

DEFAULT_MAX_RETRIES = 3
DEFAULT_POLL_INTERVAL = 2.0
METRICS_PAGE = 1000  # steps of metrics a call asks for: the server's default page (it answers up to 5000)


def every(page: Callable[[int], Page[Any]]) -> list[Any]:
    """Every item of a paged listing: `page(offset)` fetches one page (e.g. `lambda o: client.jobs.rollouts(
    job_id, limit=200, offset=o)`), followed by its next_offset until the last."""
    items: list[Any] = []
    offset: int | None = 0
    while offset is not None:
        got = page(offset)
        items += got.items
        offset = got.next_offset
    return items


def _iso(when: datetime | str | None) -> str | None:
    return when.isoformat() if isinstance(when, datetime) else when


def _job_body(spec: JobSpec | Mapping[str, Any] | None, fields: Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(spec, JobSpec):
        data: dict[str, Any] = spec.model_dump(mode="json", exclude_unset=True)
    elif spec is None:
        data = {}
    elif isinstance(spec, Mapping):
        data = dict(spec)
    else:
        raise TypeError(f"spec must be a JobSpec or a mapping, not {type(spec).__name__}")
    data.update(fields)
    if isinstance(data.get("task"), str):  # task="arithmetic" is short for task={"name": "arithmetic"}
        data["task"] = {"name": data["task"]}
    # Only what the caller set is sent: the server's defaults fill the rest.
    return validated(JobSpec, data).model_dump(mode="json", exclude_unset=True)


def _version_of(response: httpx.Response) -> int | None:
    """The version the server chose, from `Content-Disposition: attachment; filename="<job>-v<N>.tar"`."""
    match = re.search(r'-v(\d+)\.tar"?\s*$', response.headers.get("content-disposition", ""))
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------------------------------
# The two clients


def _base_url(given: str | None) -> str:
    """The server's base URL (without a trailing slash), or a ConfigurationError saying what to give instead."""
    if not given:
        raise errors.ConfigurationError(
            "no Echo2 server given: set ECHO2_BASE_URL or pass base_url (CLI: --base-url), e.g. http://127.0.0.1:8000")
    if not re.match(r"^https?://[^/\s]+", given):
        raise errors.ConfigurationError(f"base URL {given!r} is not an http:// or https:// URL")
    try:
        path = httpx.URL(given).path
    except httpx.InvalidURL as exc:
        raise errors.ConfigurationError(f"base URL {given!r} is not a valid URL: {exc}") from None
    root = given.rstrip("/")
    if path.rstrip("/").endswith("/v1"):  # each call adds /v1 itself: given twice, every call would be a 404
        raise errors.ConfigurationError(f"base URL {given!r} ends in /v1: give the server's base URL without it, "
                                        f"{root[:-3]!r} (ECHO2_BASE_URL or --base-url)")
    return root


class _BaseClient:
    def __init__(self, base_url: str | None, api_key: str | None, timeout: float | httpx.Timeout | None,
                 max_retries: int) -> None:
        self.base_url = _base_url(base_url or os.environ.get("ECHO2_BASE_URL"))
        api_key = api_key or os.environ.get("ECHO2_API_KEY")
        if not api_key:
            raise errors.ConfigurationError(
                "no API key given: set ECHO2_API_KEY or pass api_key (CLI: --api-key)")
        if max_retries < 0:
            raise errors.ConfigurationError("max_retries must be >= 0")
        self.api_key = api_key
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self.max_retries = max_retries

    def _transport_args(self) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.api_key}", "Accept": "application/json",
                   "User-Agent": f"echo2-python/{__version__}"}
        return {"headers": headers, "timeout": self.timeout, "policy": RetryPolicy(max_retries=self.max_retries)}

    def __repr__(self) -> str:  # never shows the key
        return f"{type(self).__name__}(base_url={self.base_url!r})"


class Client(_BaseClient):
    """Synchronous Echo2 client. Use as a context manager, or call `close()`."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 timeout: float | httpx.Timeout | None = None,
                 max_retries: int = DEFAULT_MAX_RETRIES) -> None:
        super().__init__(base_url, api_key, timeout, max_retries)
        self._transport = Transport(self.base_url, **self._transport_args())
        self.jobs = Jobs(self)
        self.datasets = Datasets(self)
        self.tasks = Tasks(self)
        self.workers = Workers(self)
        self.providers = Providers(self)
        self.checkpoints = Checkpoints(self)
        self.users = Users(self)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _send(self, call: Call, *, stream: bool = False) -> httpx.Response:
        return self._transport.send(call, stream=stream)

    def _call(self, call: Call, cast: Any) -> Any:
        return parse(call, cast, self._send(call))


class AsyncClient(_BaseClient):
    """Asynchronous Echo2 client with the same resources and methods as `Client` (awaitable)."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 timeout: float | httpx.Timeout | None = None,
                 max_retries: int = DEFAULT_MAX_RETRIES) -> None:
        super().__init__(base_url, api_key, timeout, max_retries)
        self._transport = AsyncTransport(self.base_url, **self._transport_args())
        self.jobs = AsyncJobs(self)
        self.datasets = AsyncDatasets(self)
        self.tasks = AsyncTasks(self)
        self.workers = AsyncWorkers(self)
        self.providers = AsyncProviders(self)
        self.checkpoints = AsyncCheckpoints(self)
        self.users = AsyncUsers(self)

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def _send(self, call: Call, *, stream: bool = False) -> httpx.Response:
        return await self._transport.send(call, stream=stream)

    async def _call(self, call: Call, cast: Any) -> Any:
        return parse(call, cast, await self._send(call))


# --------------------------------------------------------------------------------------------------
# Resources: each method is defined once, as the request it sends; the sync and async twins send it.


class _Jobs(Resource):
    @endpoint(JobRead)
    def create(self, spec: JobSpec | Mapping[str, Any] | None = None, *, idempotency_key: str | None = None,
               **fields: Any) -> Call:
        """Submit a job from a `JobSpec`, a mapping, and/or keyword fields (fields override the spec).

        `task="arithmetic"` is short for `task={"name": "arithmetic"}`. The spec is validated locally
        first (`BadRequestError` with `status=None`). Replaying the same `idempotency_key` returns the
        same job; without one a fresh key is used for this call and all its retries.
        """
        # The server replays a key's job, so a create whose answer was lost may be sent again.
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return Call("POST", "/v1/jobs", json=_job_body(spec, fields), headers=headers, replay=True)

    @endpoint(JobEstimate)
    def estimate(self, spec: JobSpec | Mapping[str, Any] | None = None, **fields: Any) -> Call:
        """What the job would cost, before it is submitted (nothing is created): learner time from earlier
        jobs like it, the workers the capacity rule would activate now, and the assumptions in words.
        Takes what `create` takes, and is refused the same way."""
        return Call("POST", "/v1/jobs:estimate", json=_job_body(spec, fields))

    @endpoint(Page[JobRead])
    def list(self, *, status: JobStatus | str | None = None, name: str | None = None, limit: int = 20,
             offset: int = 0, tinker: bool | None = None) -> Call:
        """Your jobs, newest first (all jobs for an admin); `name` matches a substring; `tinker` True lists only
        the fleet jobs of Tinker models, False leaves them out."""
        return Call("GET", "/v1/jobs", params=query(status=status, name=name, limit=limit, offset=offset,
                                                     tinker=tinker))

    @endpoint(JobRead)
    def get(self, job_id: str) -> Call:
        return Call("GET", f"/v1/jobs/{seg(job_id, 'job_id')}")

    @endpoint(JobRead)
    def cancel(self, job_id: str) -> Call:
        """Cancel a job; `ConflictError` if it already finished. Its newest version stays downloadable; earlier
        ones are deleted unless the server keeps them as checkpoints (ECHO2_KEEP_VERSIONS_EVERY)."""
        return Call("POST", f"/v1/jobs/{seg(job_id, 'job_id')}/cancel")

    @endpoint(JobRead)
    def resume(self, job_id: str) -> Call:
        """Resume a job its task paused (`paused_for` "reward": its groups could not be scored) once the task is
        fixed: it is queued, and its new learner resumes from its checkpoint. `ConflictError` otherwise."""
        return Call("POST", f"/v1/jobs/{seg(job_id, 'job_id')}/resume")

    @endpoint(JobRead)
    def update(self, job_id: str, *, budget_usd: float | None) -> Call:
        """Set the job's budget (None: no budget); a job its budget paused is queued again when it has
        money left. `ConflictError` if it already finished."""
        return Call("PATCH", f"/v1/jobs/{seg(job_id, 'job_id')}", json=json_body(JobUpdate, {"budget_usd": budget_usd}))

    @endpoint(Page[PromptRead])
    def prompts(self, job_id: str, *, limit: int = 50, offset: int = 0, held_out: bool = False) -> Call:
        """The job's training prompts, or with `held_out` those kept for evaluation and never trained on."""
        return Call("GET", f"/v1/jobs/{seg(job_id, 'job_id')}/prompts",
                    params=query(limit=limit, offset=offset, held_out=held_out or None))

    @endpoint(Page[RolloutRead])
    def rollouts(self, job_id: str, *, status: RolloutStatus | str | None = None, limit: int = 20,
                 offset: int = 0) -> Call:
        return Call("GET", f"/v1/jobs/{seg(job_id, 'job_id')}/rollouts",
                    params=query(status=status, limit=limit, offset=offset))

    @endpoint(RolloutTrace)
    def trace(self, job_id: str, rollout_id: str) -> Call:
        """One rollout group token by token: each token decoded, its version, the worker's behaviour logprob
        beside the learner's, the worker and its trust state, the audit, the rewards and what it cost."""
        return Call("GET", f"/v1/jobs/{seg(job_id, 'job_id')}/rollouts/{seg(rollout_id, 'rollout_id')}")

    @endpoint(Page[RolloutTrace])
    def traces(self, job_id: str, *, step: int, limit: int = 16, offset: int = 0) -> Call:
        """The traces of the groups learner step `step` trained on, a page at a time."""
        return Call("GET", f"/v1/jobs/{seg(job_id, 'job_id')}/traces",
                    params=query(step=step, limit=limit, offset=offset))

    @endpoint(builtins.list[StepMetrics])
    def _metrics_page(self, job_id: str, since_step: int, limit: int) -> Call:
        return Call("GET", f"/v1/jobs/{seg(job_id, 'job_id')}/metrics",
                    params=query(since_step=since_step, limit=limit))

    @endpoint(builtins.list[DecisionRead])
    def decisions(self, job_id: str, *, limit: int = 50) -> Call:
        """The scheduler's activation decisions for this job, newest first (at most `limit`, up to 200).

        Each says what happened to one worker (`activated`, `kept`, `deactivated`, `idle`, `skipped`),
        why in one `line`, and the `trigger` that made the scheduler re-solve.
        """
        return Call("GET", f"/v1/jobs/{seg(job_id, 'job_id')}/decisions", params=query(limit=limit))

    @endpoint(builtins.list[AuditRead])
    def audits(self, job_id: str, *, passed: bool | None = None, limit: int = 50) -> Call:
        """The learner's audits of this job's rollouts, newest first; `passed=False` for the failures."""
        return Call("GET", f"/v1/jobs/{seg(job_id, 'job_id')}/audits", params=query(passed=passed, limit=limit))

    @endpoint(JobReport)
    def report(self, job_id: str) -> Call:
        """Learner utilisation and waste: busy/idle seconds, and every group generated by what became of it."""
        return Call("GET", f"/v1/jobs/{seg(job_id, 'job_id')}/report")

    @endpoint(builtins.list[EvalRead])
    def evals(self, job_id: str) -> Call:
        """Held-out accuracy by step (prompts the job never trains on): the job's eval curve, oldest first."""
        return Call("GET", f"/v1/jobs/{seg(job_id, 'job_id')}/evals")

    @endpoint(JobLedger)
    def ledger(self, job_id: str, *, limit: int = 1000, offset: int = 0) -> Call:
        """What the job cost, entry by entry (a page of them), with totals by kind that sum to its cost."""
        return Call("GET", f"/v1/jobs/{seg(job_id, 'job_id')}/ledger", params=query(limit=limit, offset=offset))


def _pause(job_id: str, job: JobRead, poll_interval: float, deadline: float | None,
           timeout: float | None) -> float | None:
    """How long to sleep before polling the job again; None when it is terminal."""
    if JobStatus(job.status).is_terminal():
        return None
    if deadline is None:
        return poll_interval
    left = deadline - time.monotonic()
    if left <= 0:
        raise errors.WaitTimeoutError(f"job {job_id} is still {job.status.value} (step {job.step}) after {timeout:g} s")
    return min(poll_interval, left)


def _metrics_ask(since_step: int, rows: list[StepMetrics], limit: int | None) -> tuple[int, int] | None:
    """The next page of metrics to ask for (`since_step`, `limit`) after `rows`, or None once `limit` are in. The
    server answers at most a page of steps a call, so a long job's take several."""
    left = METRICS_PAGE if limit is None else min(METRICS_PAGE, limit - len(rows))
    return (rows[-1].step + 1 if rows else since_step, left) if left > 0 else None


class Jobs(_Jobs, SyncResource):
    """`client.jobs`: submit, list, inspect, cancel and follow GRPO training jobs."""

    def metrics(self, job_id: str, *, since_step: int = 0, limit: int | None = None) -> builtins.list[StepMetrics]:
        """Per-step training metrics from `since_step` on, oldest first: every step (fetched a page at a time), or
        the first `limit`."""
        rows: builtins.list[StepMetrics] = []
        while (ask := _metrics_ask(since_step, rows, limit)) is not None:
            page = self._metrics_page(job_id, *ask)
            rows += page
            if len(page) < ask[1]:
                break
        return rows

    def follow(self, job_id: str, *, poll_interval: float = DEFAULT_POLL_INTERVAL,
               timeout: float | None = None) -> Iterator[JobRead]:
        """Yield the job each time it changes, ending after it reaches a terminal state.

        Raises `WaitTimeoutError` when `timeout` seconds pass first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        last: JobRead | None = None
        while True:
            job = self.get(job_id)
            if job != last:
                yield job
                last = job
            pause = _pause(job_id, job, poll_interval, deadline, timeout)
            if pause is None:
                return
            time.sleep(pause)

    def wait(self, job_id: str, *, timeout: float | None = None,
             poll_interval: float = DEFAULT_POLL_INTERVAL) -> JobRead:
        """Block until the job is succeeded, failed or cancelled, and return it."""
        last: JobRead | None = None
        for job in self.follow(job_id, poll_interval=poll_interval, timeout=timeout):
            last = job
        assert last is not None
        return last


class AsyncJobs(_Jobs, AsyncResource):
    """`client.jobs` of `AsyncClient`: the same methods as `Jobs`, awaitable."""

    async def metrics(self, job_id: str, *, since_step: int = 0,
                      limit: int | None = None) -> builtins.list[StepMetrics]:
        rows: builtins.list[StepMetrics] = []
        while (ask := _metrics_ask(since_step, rows, limit)) is not None:
            page = await self._metrics_page(job_id, *ask)
            rows += page
            if len(page) < ask[1]:
                break
        return rows

    async def follow(self, job_id: str, *, poll_interval: float = DEFAULT_POLL_INTERVAL,
                     timeout: float | None = None) -> AsyncIterator[JobRead]:
        deadline = None if timeout is None else time.monotonic() + timeout
        last: JobRead | None = None
        while True:
            job = await self.get(job_id)
            if job != last:
                yield job
                last = job
            pause = _pause(job_id, job, poll_interval, deadline, timeout)
            if pause is None:
                return
            await anyio.sleep(pause)

    async def wait(self, job_id: str, *, timeout: float | None = None,
                   poll_interval: float = DEFAULT_POLL_INTERVAL) -> JobRead:
        last: JobRead | None = None
        async for job in self.follow(job_id, poll_interval=poll_interval, timeout=timeout):
            last = job
        assert last is not None
        return last


class _Datasets(Resource):
    @endpoint(DatasetRead)
    def create(self, name: str, items: Iterable[Mapping[str, Any]]) -> Call:
        rows = [dict(i) for i in items]
        return Call("POST", "/v1/datasets", json=json_body(DatasetCreate, {"name": name, "items": rows}))

    @endpoint(UploadRead)
    def _start_upload(self, name: str, size: int, sha256: str) -> Call:
        body = json_body(UploadCreate, {"name": name, "size": size, "sha256": sha256})
        return Call("POST", "/v1/datasets/uploads", json=body, replay=True)  # the same file resumes: replayable

    @endpoint(None)
    def _put_part(self, upload_id: str, index: int, data: bytes) -> Call:
        headers = {"Content-Type": "application/octet-stream", "X-Echo2-Sha256": hashlib.sha256(data).hexdigest()}
        return Call("PUT", f"/v1/datasets/uploads/{seg(upload_id, 'upload_id')}/parts/{int(index)}", content=data,
                    headers=headers, replay=True)

    @endpoint(DatasetRead)
    def _complete_upload(self, upload_id: str) -> Call:
        return Call("POST", f"/v1/datasets/uploads/{seg(upload_id, 'upload_id')}/complete")

    @endpoint(Page[DatasetRead])
    def list(self, *, limit: int = 50, offset: int = 0) -> Call:
        return Call("GET", "/v1/datasets", params=query(limit=limit, offset=offset))

    @endpoint(DatasetRead)
    def get(self, dataset_id: str) -> Call:
        return Call("GET", f"/v1/datasets/{seg(dataset_id, 'dataset_id')}")

    @endpoint(DatasetItems)
    def items(self, dataset_id: str, *, limit: int = 100, offset: int = 0) -> Call:
        return Call("GET", f"/v1/datasets/{seg(dataset_id, 'dataset_id')}/items",
                    params=query(limit=limit, offset=offset))

    @endpoint(None)
    def delete(self, dataset_id: str) -> Call:
        return Call("DELETE", f"/v1/datasets/{seg(dataset_id, 'dataset_id')}")


Progress = Callable[[int, int], None]  # (bytes sent, bytes in all)


class Datasets(_Datasets, SyncResource):
    """`client.datasets`: prompt items uploaded once and referenced by jobs (`dataset_id`)."""

    def upload(self, name: str, path: str | os.PathLike[str], *, format: str = "auto", split: str | None = None,
               progress: Progress | None = None) -> DatasetRead:
        """Create a dataset from a file of any size: JSONL (one item per line), or a Hugging Face dataset (a Parquet
        file or folder of them, an Arrow file, a `save_to_disk` folder; `pip install 'echo2[datasets]'`), sent in
        parts; an interrupted upload of the same file resumes with the parts the server lacks. The server names
        every bad line with its number, and keeps nothing of a file it refuses: fix it and upload it again.
        `progress(sent, total)` is called after each part."""
        with _UploadFile(name, path, format, split) as file:
            upload = self._start_upload(name, file.size, file.sha256)
            for index, data in file.missing(upload):
                self._put_part(upload.id, index, data)
                file.sent(len(data), progress)
            return self._complete_upload(upload.id)


class AsyncDatasets(_Datasets, AsyncResource):
    """`datasets` of `AsyncClient`: the same methods, awaitable."""

    async def upload(self, name: str, path: str | os.PathLike[str], *, format: str = "auto",
                     split: str | None = None, progress: Progress | None = None) -> DatasetRead:
        with _UploadFile(name, path, format, split) as file:
            upload = await self._start_upload(name, file.size, file.sha256)
            for index, data in file.missing(upload):
                await self._put_part(upload.id, index, data)
                file.sent(len(data), progress)
            return await self._complete_upload(upload.id)


class _UploadFile:
    """A dataset file as JSONL (converted when need be), its size and sha256, and the parts an upload lacks."""

    def __init__(self, name: str, path: str | os.PathLike[str], fmt: str, split: str | None) -> None:
        if not name or not name.strip():
            raise ValueError("a dataset needs a non-empty name")
        if fmt not in dataset_files.FORMATS:
            raise ValueError(f"format must be one of {', '.join(dataset_files.FORMATS)}, not {fmt!r}")
        self.path, self.temporary = dataset_files.as_jsonl(Path(path), fmt, split)
        self.size = self.path.stat().st_size
        if self.size == 0:
            self.close()
            raise dataset_files.DatasetFileError(f"{path} is empty")
        self.sha256 = dataset_files.sha256_of(self.path)
        self.done = 0

    def missing(self, upload: UploadRead) -> Iterator[tuple[int, bytes]]:
        have = set(upload.received)
        self.done = sum(min(upload.part_size, upload.size - i * upload.part_size) for i in have)
        with self.path.open("rb") as f:
            for index in range(upload.parts):
                if index in have:
                    continue
                f.seek(index * upload.part_size)
                yield index, f.read(upload.part_size)

    def sent(self, n: int, progress: Progress | None) -> None:
        self.done += n
        if progress is not None:
            progress(self.done, self.size)

    def close(self) -> None:
        if self.temporary:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> _UploadFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Tasks(Resource):
    @endpoint(builtins.list[TaskInfo])
    def list(self) -> Call:
        return Call("GET", "/v1/tasks")


class Tasks(_Tasks, SyncResource):
    """`client.tasks`: the registered task adapters and the JSON schema of their parameters."""


class AsyncTasks(_Tasks, AsyncResource):
    """`tasks` of `AsyncClient`: the same methods, awaitable."""


class _Workers(Resource):
    @endpoint(Page[WorkerRead])
    def list(self, *, status: WorkerStatus | str | None = None, job_id: str | None = None,
             include_deregistered: bool = True, limit: int = 100, offset: int = 0) -> Call:
        """Oldest first; `include_deregistered=False` leaves out the workers that have left (a provider's machines
        now)."""
        return Call("GET", "/v1/workers", params=query(status=status, job_id=job_id,
                                                       include_deregistered=include_deregistered, limit=limit,
                                                       offset=offset))

    @endpoint(WorkerRead)
    def get(self, worker_id: str) -> Call:
        """A worker, with its trust state (`trust`, `trust_reason`, `quarantined_until`)."""
        return Call("GET", f"/v1/workers/{seg(worker_id, 'worker_id')}")

    @endpoint(builtins.list[AuditRead])
    def audits(self, worker_id: str, *, passed: bool | None = None, limit: int = 100) -> Call:
        """The evidence behind a worker's trust, newest first (the worker, its provider and admins)."""
        return Call("GET", f"/v1/workers/{seg(worker_id, 'worker_id')}/audits",
                    params=query(passed=passed, limit=limit))


class Workers(_Workers, SyncResource):
    """`client.workers`: the workers on your jobs (a provider sees its own; an admin sees all)."""


class AsyncWorkers(_Workers, AsyncResource):
    """`workers` of `AsyncClient`: the same methods, awaitable."""


def _statement(provider_id: str | None, since: datetime | str | None, until: datetime | str | None, limit: int,
               offset: int, csv: bool) -> Call:
    path = "/v1/providers/me/statement" if provider_id is None else \
        f"/v1/providers/{seg(provider_id, 'provider_id')}/statement"
    params = query(since=_iso(since), until=_iso(until), limit=limit, offset=offset, format="csv" if csv else None)
    return Call("GET", path, params=params)


class _Providers(Resource):
    @endpoint(ProviderCreated)
    def create(self, name: str, *, contact: str | None = None) -> Call:
        return Call("POST", "/v1/providers", json=json_body(ProviderCreate, {"name": name, "contact": contact}))

    @endpoint(ProviderRead)
    def me(self) -> Call:
        return Call("GET", "/v1/providers/me")

    @endpoint(builtins.list[ProviderRead])
    def list(self) -> Call:
        return Call("GET", "/v1/providers")

    @endpoint(ProviderStatement)
    def statement(self, provider_id: str | None = None, *, since: datetime | str | None = None,
                  until: datetime | str | None = None, limit: int = 1000, offset: int = 0) -> Call:
        """A provider's ledger entries from `since` to `until` (a page of them) and its totals per worker and
        per job over the whole period: your own with a provider token, any provider's with an admin key."""
        return _statement(provider_id, since, until, limit, offset, csv=False)

    @endpoint(str)
    def statement_csv(self, provider_id: str | None = None, *, since: datetime | str | None = None,
                      until: datetime | str | None = None, limit: int = 1000, offset: int = 0) -> Call:
        """The same page of entries as CSV, with a header row."""
        return _statement(provider_id, since, until, limit, offset, csv=True)


class Providers(_Providers, SyncResource):
    """`client.providers`: sign providers up (admin key) and read the calling provider (provider token)."""


class AsyncProviders(_Providers, AsyncResource):
    """`providers` of `AsyncClient`: the same methods, awaitable."""


class _Users(Resource):
    @endpoint(UserRead)
    def me(self) -> Call:
        return Call("GET", "/v1/me")

    @endpoint(UserCreated)
    def create(self, name: str, *, role: Role | str = Role.user) -> Call:
        return Call("POST", "/v1/users", json=json_body(UserCreate, {"name": name, "role": role}))

    @endpoint(builtins.list[UserRead])
    def list(self) -> Call:
        return Call("GET", "/v1/users")

    @endpoint(ApiKeyCreated)
    def create_key(self, user_id: str) -> Call:
        return Call("POST", f"/v1/users/{seg(user_id, 'user_id')}/keys")

    @endpoint(builtins.list[TokenRead])
    def list_keys(self, user_id: str, *, include_revoked: bool = False) -> Call:
        """A user's API keys (mine, or any as admin): ids, prefixes, dates; never the secrets."""
        return Call("GET", f"/v1/users/{seg(user_id, 'user_id')}/keys",
                    params=query(include_revoked=include_revoked or None))

    @endpoint(None)
    def revoke_key(self, token_id: str) -> Call:
        """Revoke one of my API keys (a leaked one, or an old one once its successor works); not my last."""
        return Call("DELETE", f"/v1/tokens/{seg(token_id, 'token_id')}")

    @endpoint(UserRead)
    def set_quotas(self, user_id: str, *, max_concurrent_jobs: int | None = None,
                   max_usd_per_day: float | None = None) -> Call:
        """(admin) The user's limits, None for none; jobs beyond them wait in the queue or pause."""
        quotas = {"max_concurrent_jobs": max_concurrent_jobs, "max_usd_per_day": max_usd_per_day}
        return Call("PUT", f"/v1/users/{seg(user_id, 'user_id')}/quotas", json=json_body(Quotas, quotas))

    @endpoint(TinkerUsage)
    def tinker_usage(self, *, session_id: str | None = None, limit: int = 1000, offset: int = 0) -> Call:
        """What my Tinker API requests cost (a page of entries), with totals by session, model and kind."""
        return Call("GET", "/v1/tinker/usage", params=query(session_id=session_id, limit=limit, offset=offset))


class Users(_Users, SyncResource):
    """`client.users`: who am I; admins create users (each with an API key, shown once)."""


class AsyncUsers(_Users, AsyncResource):
    """`users` of `AsyncClient`: the same methods, awaitable."""


# --------------------------------------------------------------------------------------------------
# Checkpoints: a streamed tar, extracted as it arrives, checked against the version's manifest


class _Checkpoints(Resource):
    @endpoint(builtins.list[VersionRead])
    def versions(self, job_id: str) -> Call:
        return Call("GET", f"/v1/jobs/{seg(job_id, 'job_id')}/versions")

    @endpoint(Manifest)
    def manifest(self, job_id: str, version: int) -> Call:
        return Call("GET", f"/v1/jobs/{seg(job_id, 'job_id')}/versions/{int(version)}/manifest")

    def _tar(self, job_id: str, version: int | None) -> Call:
        return Call("GET", f"/v1/jobs/{seg(job_id, 'job_id')}/checkpoint", params=query(version=version),
                    headers={"Accept": "application/x-tar"})

    def _export(self, job_id: str, version: int | None, adapter: bool) -> Call:
        return Call("GET", f"/v1/jobs/{seg(job_id, 'job_id')}/export",
                    params=query(version=version, adapter=adapter or None), headers={"Accept": "application/x-tar"})


class Checkpoints(_Checkpoints, SyncResource):
    """`client.checkpoints`: a job's published weight versions, downloadable as HF model folders."""

    def download(self, job_id: str, dest_dir: str | os.PathLike[str], *, version: int | None = None,
                 overwrite: bool = False) -> Path:
        """Download a version (default: the final checkpoint, else the latest) into `dest_dir`.

        The folder appears complete or not at all: files are extracted next to it and moved into place
        last. Entries that would escape the folder, links and devices are refused (`CheckpointError`),
        and every file is checked against the manifest's size and sha256. `dest_dir` must not exist or
        be empty unless `overwrite` is true.
        """
        dest = check_dest(Path(dest_dir), overwrite)
        response = self._client._send(self._tar(job_id, version), stream=True)
        try:
            chosen = version if version is not None else _version_of(response)
            manifest = self.manifest(job_id, chosen) if chosen is not None else None
            return _extract(response, dest, overwrite, manifest)
        finally:
            response.close()


    def export(self, job_id: str, out_dir: str | os.PathLike[str], *, adapter: bool = False,
               version: int | None = None, overwrite: bool = False) -> Path:
        """Write the job's model into `out_dir` as a plain Hugging Face folder that `transformers` and vLLM load
        as it is (safetensors, config, tokenizer, generation config): its final version, a LoRA job merged, or
        with `adapter` its adapter alone (naming the job's base model). The folder appears complete or not at
        all, as with `download`. To publish it: `push_to_hub(out_dir, repo_id)`."""
        dest = check_dest(Path(out_dir), overwrite)
        response = self._client._send(self._export(job_id, version, adapter), stream=True)
        try:
            return _extract(response, dest, overwrite, None)
        finally:
            response.close()


def _extract(response: httpx.Response, dest: Path, overwrite: bool, manifest: Any) -> Path:
    """The streamed tar into `dest`, all or nothing (Staging), every file checked against `manifest` if any."""
    with Staging(dest, overwrite) as staging, TarSink(staging.path, manifest) as sink:
        try:
            for block in response.iter_bytes():
                sink.feed(block)
        except httpx.TransportError as exc:
            raise connection_error(exc, response.request) from exc
        sink.finish()
        staging.commit()
    return dest


async def _aextract(response: httpx.Response, dest: Path, overwrite: bool, manifest: Any) -> Path:
    """`_extract` of an async stream."""
    with Staging(dest, overwrite) as staging, TarSink(staging.path, manifest) as sink:
        try:
            async for block in response.aiter_bytes():
                sink.feed(block)
        except httpx.TransportError as exc:
            raise connection_error(exc, response.request) from exc
        sink.finish()
        staging.commit()
    return dest


def push_to_hub(folder: str | os.PathLike[str], repo_id: str, *, private: bool = False,
                token: str | None = None) -> str:
    """Upload an exported folder to the Hugging Face Hub as model repository `repo_id` (created if need be), with
    `huggingface_hub` (`pip install 'echo2[hub]'`) and its usual token (HF_TOKEN, or `hf auth login`). Returns the
    repository's URL."""
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise errors.ConfigurationError("pushing to the Hub needs huggingface_hub: pip install 'echo2[hub]'") from None
    hub = HfApi(token=token)
    url = hub.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    hub.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                      commit_message="Upload a model exported from Echo2")
    return str(url)


class AsyncCheckpoints(_Checkpoints, AsyncResource):
    """`checkpoints` of `AsyncClient`: the same methods, awaitable."""

    async def download(self, job_id: str, dest_dir: str | os.PathLike[str], *, version: int | None = None,
                       overwrite: bool = False) -> Path:
        dest = check_dest(Path(dest_dir), overwrite)
        response = await self._client._send(self._tar(job_id, version), stream=True)
        try:
            chosen = version if version is not None else _version_of(response)
            manifest = await self.manifest(job_id, chosen) if chosen is not None else None
            return await _aextract(response, dest, overwrite, manifest)
        finally:
            await response.aclose()

    async def export(self, job_id: str, out_dir: str | os.PathLike[str], *, adapter: bool = False,
                     version: int | None = None, overwrite: bool = False) -> Path:
        dest = check_dest(Path(out_dir), overwrite)
        response = await self._client._send(self._export(job_id, version, adapter), stream=True)
        try:
            return await _aextract(response, dest, overwrite, None)
        finally:
            await response.aclose()
