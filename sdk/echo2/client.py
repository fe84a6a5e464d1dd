"""`Client` and `AsyncClient`: the Echo2 REST API as typed resources, shaped like openai-python.

    with echo2.Client() as client:            # ECHO2_BASE_URL / ECHO2_API_KEY
        job = client.jobs.create(name="demo", base_model="echo2:tiny", task="arithmetic", max_steps=20)
        job = client.jobs.wait(job.id)
        client.checkpoints.download(job.id, "out/")

Every method returns protocol models (never raw dicts) and raises the classes of `echo2.errors`.
Requests are retried with exponential backoff and jitter on connection errors, 429, 503 and
409-with-Retry-After, honouring Retry-After; a job create carries one Idempotency-Key across its
retries, so a retried submit can never create two jobs. The request each method sends is built once,
by the `_*Base` classes; `Client` and `AsyncClient` differ only in how they send it.
"""

from __future__ import annotations

import builtins
import hashlib
import os
import re
import shutil
import tarfile
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any, Generic, TypeVar, cast
from urllib.parse import quote

import anyio
import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from . import __version__, errors
from ._retry import RetryPolicy, retry_after
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
    StepMetrics,
    TaskInfo,
    UserCreate,
    UserCreated,
    UserRead,
    VersionRead,
    WorkerRead,
    WorkerStatus,
)

__all__ = ["Client", "AsyncClient", "DEFAULT_TIMEOUT", "DEFAULT_MAX_RETRIES"]

DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
DEFAULT_MAX_RETRIES = 3
DEFAULT_POLL_INTERVAL = 2.0

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


# --------------------------------------------------------------------------------------------------
# Requests, parsing and local validation (shared by both clients)


@dataclass(frozen=True)
class _Req(Generic[T]):
    """One logical API call: what to send and what the success body parses into (None: no body)."""

    method: str
    path: str
    cast: type[T] | None
    params: Mapping[str, Any] | None = None
    json: Any = None
    files: Mapping[str, Any] | None = None
    data: Mapping[str, str] | None = None
    headers: Mapping[str, str] | None = None


@cache
def _adapter(cast: Any) -> TypeAdapter[Any]:
    return TypeAdapter(cast)


def _parse(req: _Req[T], response: httpx.Response) -> T:
    if req.cast is None:
        return None  # type: ignore[return-value]
    target: Any = req.cast
    try:
        return cast(T, _adapter(target).validate_json(response.content))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        name = getattr(req.cast, "__name__", str(req.cast))
        raise errors.UnexpectedResponseError(
            f"{req.method} {req.path} answered {response.status_code} with a body that is not a {name} "
            f"({where}: {first['msg']}); is ECHO2_BASE_URL an Echo2 server of a compatible version?",
            response=response,
        ) from None


def _validated(model: type[M], data: Any) -> M:
    """Validate a request body locally, raising the same field/reason error the server would."""
    if isinstance(data, model):
        return data
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        reasons = [errors.FieldReason(".".join(str(p) for p in e["loc"]), e["msg"]) for e in exc.errors()]
        detail = str(reasons[0])
        title = f"Invalid {model.__name__} (not sent)"
        raise errors.BadRequestError(errors.format_message(None, title, detail, reasons), status=None,
                                     title=title, detail=detail, errors=reasons) from None


def _seg(value: str | int, what: str) -> str:
    """A path segment from a caller-given ID, quoted so it can never change the route."""
    text = str(value)
    if not text:
        raise ValueError(f"{what} must be a non-empty string")
    return quote(text, safe="")


def _params(**values: Any) -> dict[str, Any]:
    return {k: (v.value if hasattr(v, "value") else v) for k, v in values.items() if v is not None}


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
    return _validated(JobSpec, data).model_dump(mode="json", exclude_unset=True)


def _transport_error(exc: httpx.TransportError, request: httpx.Request) -> errors.ConnectionError:
    where = f"{request.method} {request.url}"
    if isinstance(exc, httpx.TimeoutException):
        return errors.APITimeoutError(f"request timed out: {where} ({type(exc).__name__})", request=request)
    reason = str(exc) or type(exc).__name__
    return errors.ConnectionError(f"could not reach the Echo2 server: {where}: {reason}", request=request)


def _status_error(response: httpx.Response) -> errors.APIStatusError:
    return errors.error_from_response(response, retry_after(response.headers))


def _terminal(job: JobRead) -> bool:
    return JobStatus(job.status).is_terminal()


def _wait_timeout(job_id: str, timeout: float | None, job: JobRead) -> errors.WaitTimeoutError:
    return errors.WaitTimeoutError(
        f"job {job_id} is still {job.status.value} (step {job.step}) after {timeout:g} s")


# --------------------------------------------------------------------------------------------------
# Configuration and the two transports


class _BaseClient:
    def __init__(self, base_url: str | None, api_key: str | None, timeout: float | httpx.Timeout | None,
                 max_retries: int) -> None:
        base_url = base_url or os.environ.get("ECHO2_BASE_URL")
        if not base_url:
            raise errors.ConfigurationError(
                "no Echo2 server given: set ECHO2_BASE_URL or pass base_url (CLI: --base-url), e.g. http://127.0.0.1:8000")
        if not re.match(r"^https?://[^/\s]+", base_url):
            raise errors.ConfigurationError(f"base URL {base_url!r} is not an http:// or https:// URL")
        api_key = api_key or os.environ.get("ECHO2_API_KEY")
        if not api_key:
            raise errors.ConfigurationError(
                "no API key given: set ECHO2_API_KEY or pass api_key (CLI: --api-key)")
        if max_retries < 0:
            raise errors.ConfigurationError("max_retries must be >= 0")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self.max_retries = max_retries
        self._policy = RetryPolicy(max_retries=max_retries)

    def _default_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}", "Accept": "application/json",
                "User-Agent": f"echo2-python/{__version__}"}

    def _build(self, http: httpx.Client | httpx.AsyncClient, req: _Req[Any]) -> httpx.Request:
        return http.build_request(req.method, req.path, params=req.params, json=req.json, files=req.files,
                                  data=req.data, headers=req.headers)

    def __repr__(self) -> str:  # never shows the key
        return f"{type(self).__name__}(base_url={self.base_url!r})"


class Client(_BaseClient):
    """Synchronous Echo2 client. Use as a context manager, or call `close()`."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 timeout: float | httpx.Timeout | None = None,
                 max_retries: int = DEFAULT_MAX_RETRIES) -> None:
        super().__init__(base_url, api_key, timeout, max_retries)
        self._http = httpx.Client(base_url=self.base_url, headers=self._default_headers(),
                                  timeout=self.timeout)
        self.jobs = Jobs(self)
        self.datasets = Datasets(self)
        self.tasks = Tasks(self)
        self.workers = Workers(self)
        self.providers = Providers(self)
        self.checkpoints = Checkpoints(self)
        self.users = Users(self)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _send(self, req: _Req[Any], *, stream: bool = False) -> httpx.Response:
        attempt = 0
        while True:
            request = self._build(self._http, req)
            try:
                response = self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                if attempt < self.max_retries and self._policy.should_retry_exception(exc, request):
                    time.sleep(self._policy.delay(attempt))
                    attempt += 1
                    continue
                raise _transport_error(exc, request) from exc
            if response.is_success:
                return response
            if attempt < self.max_retries and self._policy.should_retry_status(response):
                response.close()
                time.sleep(self._policy.delay(attempt, response))
                attempt += 1
                continue
            response.read()
            response.close()
            raise _status_error(response)

    def _call(self, req: _Req[T]) -> T:
        return _parse(req, self._send(req))


class AsyncClient(_BaseClient):
    """Asynchronous Echo2 client with the same resources and methods as `Client` (awaitable)."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 timeout: float | httpx.Timeout | None = None,
                 max_retries: int = DEFAULT_MAX_RETRIES) -> None:
        super().__init__(base_url, api_key, timeout, max_retries)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self._default_headers(),
                                       timeout=self.timeout)
        self.jobs = AsyncJobs(self)
        self.datasets = AsyncDatasets(self)
        self.tasks = AsyncTasks(self)
        self.workers = AsyncWorkers(self)
        self.providers = AsyncProviders(self)
        self.checkpoints = AsyncCheckpoints(self)
        self.users = AsyncUsers(self)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def _send(self, req: _Req[Any], *, stream: bool = False) -> httpx.Response:
        attempt = 0
        while True:
            request = self._build(self._http, req)
            try:
                response = await self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                if attempt < self.max_retries and self._policy.should_retry_exception(exc, request):
                    await anyio.sleep(self._policy.delay(attempt))
                    attempt += 1
                    continue
                raise _transport_error(exc, request) from exc
            if response.is_success:
                return response
            if attempt < self.max_retries and self._policy.should_retry_status(response):
                await response.aclose()
                await anyio.sleep(self._policy.delay(attempt, response))
                attempt += 1
                continue
            await response.aread()
            await response.aclose()
            raise _status_error(response)

    async def _call(self, req: _Req[T]) -> T:
        return _parse(req, await self._send(req))


# --------------------------------------------------------------------------------------------------
# Resources: `_*Base` builds each request once; the sync and async classes send it.


class _Resource:
    def __init__(self, client: Any) -> None:
        self._client = client


# --------------------------------------------------------------------------------------------------
# Money: a job's estimate and ledger, a provider's statement (mixed into the jobs and providers resources)


def _iso(when: datetime | str | None) -> str | None:
    return when.isoformat() if isinstance(when, datetime) else when


class _JobsMoneyBase(_Resource):
    def _estimate(self, spec: JobSpec | Mapping[str, Any] | None, fields: Mapping[str, Any]) -> _Req[JobEstimate]:
        return _Req("POST", "/v1/jobs:estimate", JobEstimate, json=_job_body(spec, fields))

    def _ledger(self, job_id: str, limit: int, offset: int) -> _Req[JobLedger]:
        return _Req("GET", f"/v1/jobs/{_seg(job_id, 'job_id')}/ledger", JobLedger,
                    params=_params(limit=limit, offset=offset))


class _JobsMoney(_JobsMoneyBase):
    _client: Client

    def estimate(self, spec: JobSpec | Mapping[str, Any] | None = None, **fields: Any) -> JobEstimate:
        """What the job would cost, before it is submitted (nothing is created): learner time from earlier
        jobs like it, the workers the capacity rule would activate now, and the assumptions in words.
        Takes what `create` takes, and is refused the same way."""
        return self._client._call(self._estimate(spec, fields))

    def ledger(self, job_id: str, *, limit: int = 1000, offset: int = 0) -> JobLedger:
        """What the job cost, entry by entry (a page of them), with totals by kind that sum to its cost."""
        return self._client._call(self._ledger(job_id, limit, offset))


class _AsyncJobsMoney(_JobsMoneyBase):
    _client: AsyncClient

    async def estimate(self, spec: JobSpec | Mapping[str, Any] | None = None, **fields: Any) -> JobEstimate:
        return await self._client._call(self._estimate(spec, fields))

    async def ledger(self, job_id: str, *, limit: int = 1000, offset: int = 0) -> JobLedger:
        return await self._client._call(self._ledger(job_id, limit, offset))


class _ProvidersMoneyBase(_Resource):
    def _statement(self, provider_id: str | None, since: datetime | str | None, until: datetime | str | None,
                   limit: int, offset: int, csv: bool = False) -> _Req[ProviderStatement]:
        path = "/v1/providers/me/statement" if provider_id is None else \
            f"/v1/providers/{_seg(provider_id, 'provider_id')}/statement"
        params = _params(since=_iso(since), until=_iso(until), limit=limit, offset=offset,
                         format="csv" if csv else None)
        return _Req("GET", path, ProviderStatement, params=params)


class _ProvidersMoney(_ProvidersMoneyBase):
    _client: Client

    def statement(self, provider_id: str | None = None, *, since: datetime | str | None = None,
                  until: datetime | str | None = None, limit: int = 1000, offset: int = 0) -> ProviderStatement:
        """A provider's ledger entries from `since` to `until` (a page of them) and its totals per worker and
        per job over the whole period: your own with a provider token, any provider's with an admin key."""
        return self._client._call(self._statement(provider_id, since, until, limit, offset))

    def statement_csv(self, provider_id: str | None = None, *, since: datetime | str | None = None,
                      until: datetime | str | None = None, limit: int = 1000, offset: int = 0) -> str:
        """The same page of entries as CSV, with a header row."""
        return self._client._send(self._statement(provider_id, since, until, limit, offset, csv=True)).text


class _AsyncProvidersMoney(_ProvidersMoneyBase):
    _client: AsyncClient

    async def statement(self, provider_id: str | None = None, *, since: datetime | str | None = None,
                        until: datetime | str | None = None, limit: int = 1000,
                        offset: int = 0) -> ProviderStatement:
        return await self._client._call(self._statement(provider_id, since, until, limit, offset))

    async def statement_csv(self, provider_id: str | None = None, *, since: datetime | str | None = None,
                            until: datetime | str | None = None, limit: int = 1000, offset: int = 0) -> str:
        return (await self._client._send(self._statement(provider_id, since, until, limit, offset, csv=True))).text


class _JobsBase(_Resource):
    def _create(self, spec: JobSpec | Mapping[str, Any] | None, idempotency_key: str | None,
                fields: Mapping[str, Any]) -> _Req[JobRead]:
        body = _job_body(spec, fields)
        # One key per logical submit, reused by every retry of it: a retried create never makes two jobs.
        key = idempotency_key or str(uuid.uuid4())
        return _Req("POST", "/v1/jobs", JobRead, json=body, headers={"Idempotency-Key": key})

    def _list(self, status: JobStatus | str | None, name: str | None, limit: int,
              offset: int) -> _Req[Page[JobRead]]:
        return _Req("GET", "/v1/jobs", Page[JobRead],
                    params=_params(status=status, name=name, limit=limit, offset=offset))

    def _get(self, job_id: str) -> _Req[JobRead]:
        return _Req("GET", f"/v1/jobs/{_seg(job_id, 'job_id')}", JobRead)

    def _cancel(self, job_id: str) -> _Req[JobRead]:
        return _Req("POST", f"/v1/jobs/{_seg(job_id, 'job_id')}/cancel", JobRead)

    def _update(self, job_id: str, budget_usd: float | None) -> _Req[JobRead]:
        body = _validated(JobUpdate, {"budget_usd": budget_usd})
        return _Req("PATCH", f"/v1/jobs/{_seg(job_id, 'job_id')}", JobRead, json=body.model_dump(mode="json"))

    def _prompts(self, job_id: str, limit: int, offset: int, held_out: bool) -> _Req[Page[PromptRead]]:
        return _Req("GET", f"/v1/jobs/{_seg(job_id, 'job_id')}/prompts", Page[PromptRead],
                    params=_params(limit=limit, offset=offset, held_out=held_out or None))

    def _rollouts(self, job_id: str, status: RolloutStatus | str | None, limit: int,
                  offset: int) -> _Req[Page[RolloutRead]]:
        return _Req("GET", f"/v1/jobs/{_seg(job_id, 'job_id')}/rollouts", Page[RolloutRead],
                    params=_params(status=status, limit=limit, offset=offset))

    def _metrics(self, job_id: str, since_step: int, limit: int | None) -> _Req[list[StepMetrics]]:
        return _Req("GET", f"/v1/jobs/{_seg(job_id, 'job_id')}/metrics", list[StepMetrics],
                    params=_params(since_step=since_step, limit=limit))

    def _decisions(self, job_id: str, limit: int) -> _Req[list[DecisionRead]]:
        return _Req("GET", f"/v1/jobs/{_seg(job_id, 'job_id')}/decisions", list[DecisionRead],
                    params=_params(limit=limit))

    def _audits(self, job_id: str, passed: bool | None, limit: int) -> _Req[list[AuditRead]]:
        return _Req("GET", f"/v1/jobs/{_seg(job_id, 'job_id')}/audits", list[AuditRead],
                    params=_params(passed=passed, limit=limit))

    def _report(self, job_id: str) -> _Req[JobReport]:
        return _Req("GET", f"/v1/jobs/{_seg(job_id, 'job_id')}/report", JobReport)

    def _evals(self, job_id: str) -> _Req[list[EvalRead]]:
        return _Req("GET", f"/v1/jobs/{_seg(job_id, 'job_id')}/evals", list[EvalRead])


class Jobs(_JobsBase, _JobsMoney):
    """`client.jobs`: submit, list, inspect, cancel and follow GRPO training jobs."""
    _client: Client


    def create(self, spec: JobSpec | Mapping[str, Any] | None = None, *, idempotency_key: str | None = None,
               **fields: Any) -> JobRead:
        """Submit a job from a `JobSpec`, a mapping, and/or keyword fields (fields override the spec).

        `task="arithmetic"` is short for `task={"name": "arithmetic"}`. The spec is validated locally
        first (`BadRequestError` with `status=None`). Replaying the same `idempotency_key` returns the
        same job; without one a fresh key is used for this call and all its retries.
        """
        return self._client._call(self._create(spec, idempotency_key, fields))

    def list(self, *, status: JobStatus | str | None = None, name: str | None = None, limit: int = 20,
             offset: int = 0) -> Page[JobRead]:
        """Your jobs, newest first (all jobs for an admin); `name` matches a substring."""
        return self._client._call(self._list(status, name, limit, offset))

    def get(self, job_id: str) -> JobRead:
        return self._client._call(self._get(job_id))

    def cancel(self, job_id: str) -> JobRead:
        """Cancel a job; `ConflictError` if it already finished."""
        return self._client._call(self._cancel(job_id))

    def update(self, job_id: str, *, budget_usd: float | None) -> JobRead:
        """Set the job's budget (None: no budget); a job its budget paused is queued again when it has
        money left. `ConflictError` if it already finished."""
        return self._client._call(self._update(job_id, budget_usd))

    def prompts(self, job_id: str, *, limit: int = 50, offset: int = 0, held_out: bool = False) -> Page[PromptRead]:
        """The job's training prompts, or with `held_out` those kept for evaluation and never trained on."""
        return self._client._call(self._prompts(job_id, limit, offset, held_out))

    def rollouts(self, job_id: str, *, status: RolloutStatus | str | None = None, limit: int = 20,
                 offset: int = 0) -> Page[RolloutRead]:
        return self._client._call(self._rollouts(job_id, status, limit, offset))

    def metrics(self, job_id: str, *, since_step: int = 0, limit: int | None = None) -> builtins.list[StepMetrics]:
        """Per-step training metrics from `since_step` on, oldest first."""
        return self._client._call(self._metrics(job_id, since_step, limit))

    def decisions(self, job_id: str, *, limit: int = 50) -> builtins.list[DecisionRead]:
        """The scheduler's activation decisions for this job, newest first (at most `limit`, up to 200).

        Each says what happened to one worker (`activated`, `kept`, `deactivated`, `idle`, `skipped`),
        why in one `line`, and the `trigger` that made the scheduler re-solve.
        """
        return self._client._call(self._decisions(job_id, limit))

    def audits(self, job_id: str, *, passed: bool | None = None, limit: int = 50) -> builtins.list[AuditRead]:
        """The learner's audits of this job's rollouts, newest first; `passed=False` for the failures."""
        return self._client._call(self._audits(job_id, passed, limit))

    def report(self, job_id: str) -> JobReport:
        """Learner utilisation and waste: busy/idle seconds, and every group generated by what became of it."""
        return self._client._call(self._report(job_id))

    def evals(self, job_id: str) -> builtins.list[EvalRead]:
        """Held-out accuracy by step (prompts the job never trains on): the job's eval curve, oldest first."""
        return self._client._call(self._evals(job_id))

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
            if _terminal(job):
                return
            pause = poll_interval
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _wait_timeout(job_id, timeout, job)
                pause = min(pause, left)
            time.sleep(pause)

    def wait(self, job_id: str, *, timeout: float | None = None,
             poll_interval: float = DEFAULT_POLL_INTERVAL) -> JobRead:
        """Block until the job is succeeded, failed or cancelled, and return it."""
        last: JobRead | None = None
        for job in self.follow(job_id, poll_interval=poll_interval, timeout=timeout):
            last = job
        assert last is not None
        return last


class AsyncJobs(_JobsBase, _AsyncJobsMoney):
    """`client.jobs` of `AsyncClient`: the same methods as `Jobs`, awaitable."""
    _client: AsyncClient


    async def create(self, spec: JobSpec | Mapping[str, Any] | None = None, *,
                     idempotency_key: str | None = None, **fields: Any) -> JobRead:
        return await self._client._call(self._create(spec, idempotency_key, fields))

    async def list(self, *, status: JobStatus | str | None = None, name: str | None = None, limit: int = 20,
                   offset: int = 0) -> Page[JobRead]:
        return await self._client._call(self._list(status, name, limit, offset))

    async def get(self, job_id: str) -> JobRead:
        return await self._client._call(self._get(job_id))

    async def cancel(self, job_id: str) -> JobRead:
        return await self._client._call(self._cancel(job_id))

    async def update(self, job_id: str, *, budget_usd: float | None) -> JobRead:
        return await self._client._call(self._update(job_id, budget_usd))

    async def prompts(self, job_id: str, *, limit: int = 50, offset: int = 0,
                      held_out: bool = False) -> Page[PromptRead]:
        return await self._client._call(self._prompts(job_id, limit, offset, held_out))

    async def rollouts(self, job_id: str, *, status: RolloutStatus | str | None = None, limit: int = 20,
                       offset: int = 0) -> Page[RolloutRead]:
        req = self._rollouts(job_id, status, limit, offset)
        return await self._client._call(req)

    async def metrics(self, job_id: str, *, since_step: int = 0,
                      limit: int | None = None) -> builtins.list[StepMetrics]:
        return await self._client._call(self._metrics(job_id, since_step, limit))

    async def decisions(self, job_id: str, *, limit: int = 50) -> builtins.list[DecisionRead]:
        return await self._client._call(self._decisions(job_id, limit))

    async def audits(self, job_id: str, *, passed: bool | None = None,
                     limit: int = 50) -> builtins.list[AuditRead]:
        return await self._client._call(self._audits(job_id, passed, limit))

    async def report(self, job_id: str) -> JobReport:
        return await self._client._call(self._report(job_id))

    async def evals(self, job_id: str) -> builtins.list[EvalRead]:
        return await self._client._call(self._evals(job_id))

    async def follow(self, job_id: str, *, poll_interval: float = DEFAULT_POLL_INTERVAL,
                     timeout: float | None = None) -> AsyncIterator[JobRead]:
        deadline = None if timeout is None else time.monotonic() + timeout
        last: JobRead | None = None
        while True:
            job = await self.get(job_id)
            if job != last:
                yield job
                last = job
            if _terminal(job):
                return
            pause = poll_interval
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _wait_timeout(job_id, timeout, job)
                pause = min(pause, left)
            await anyio.sleep(pause)

    async def wait(self, job_id: str, *, timeout: float | None = None,
                   poll_interval: float = DEFAULT_POLL_INTERVAL) -> JobRead:
        last: JobRead | None = None
        async for job in self.follow(job_id, poll_interval=poll_interval, timeout=timeout):
            last = job
        assert last is not None
        return last


class _DatasetsBase(_Resource):
    def _create(self, name: str, items: Iterable[Mapping[str, Any]]) -> _Req[DatasetRead]:
        body = _validated(DatasetCreate, {"name": name, "items": [dict(i) for i in items]})
        return _Req("POST", "/v1/datasets", DatasetRead, json=body.model_dump(mode="json"))

    def _upload(self, name: str, path: str | os.PathLike[str]) -> _Req[DatasetRead]:
        if not name or not name.strip():
            raise ValueError("a dataset needs a non-empty name")
        file = Path(path)
        content = file.read_bytes()  # in memory: the server caps bodies anyway, and a retry must resend it
        return _Req("POST", "/v1/datasets/upload", DatasetRead,
                    files={"file": (file.name, content, "application/x-ndjson")}, data={"name": name})

    def _list(self, limit: int, offset: int) -> _Req[Page[DatasetRead]]:
        return _Req("GET", "/v1/datasets", Page[DatasetRead], params=_params(limit=limit, offset=offset))

    def _get(self, dataset_id: str) -> _Req[DatasetRead]:
        return _Req("GET", f"/v1/datasets/{_seg(dataset_id, 'dataset_id')}", DatasetRead)

    def _items(self, dataset_id: str, limit: int, offset: int) -> _Req[DatasetItems]:
        return _Req("GET", f"/v1/datasets/{_seg(dataset_id, 'dataset_id')}/items", DatasetItems,
                    params=_params(limit=limit, offset=offset))

    def _delete(self, dataset_id: str) -> _Req[None]:
        return _Req("DELETE", f"/v1/datasets/{_seg(dataset_id, 'dataset_id')}", None)


class Datasets(_DatasetsBase):
    """`client.datasets`: prompt items uploaded once and referenced by jobs (`dataset_id`)."""
    _client: Client


    def create(self, name: str, items: Iterable[Mapping[str, Any]]) -> DatasetRead:
        return self._client._call(self._create(name, items))

    def upload(self, name: str, path: str | os.PathLike[str]) -> DatasetRead:
        """Create a dataset from a JSONL file (one JSON object per line); the server validates each line."""
        return self._client._call(self._upload(name, path))

    def list(self, *, limit: int = 50, offset: int = 0) -> Page[DatasetRead]:
        return self._client._call(self._list(limit, offset))

    def get(self, dataset_id: str) -> DatasetRead:
        return self._client._call(self._get(dataset_id))

    def items(self, dataset_id: str, *, limit: int = 100, offset: int = 0) -> DatasetItems:
        return self._client._call(self._items(dataset_id, limit, offset))

    def delete(self, dataset_id: str) -> None:
        self._client._call(self._delete(dataset_id))


class AsyncDatasets(_DatasetsBase):
    _client: AsyncClient

    async def create(self, name: str, items: Iterable[Mapping[str, Any]]) -> DatasetRead:
        return await self._client._call(self._create(name, items))

    async def upload(self, name: str, path: str | os.PathLike[str]) -> DatasetRead:
        return await self._client._call(self._upload(name, path))

    async def list(self, *, limit: int = 50, offset: int = 0) -> Page[DatasetRead]:
        return await self._client._call(self._list(limit, offset))

    async def get(self, dataset_id: str) -> DatasetRead:
        return await self._client._call(self._get(dataset_id))

    async def items(self, dataset_id: str, *, limit: int = 100, offset: int = 0) -> DatasetItems:
        return await self._client._call(self._items(dataset_id, limit, offset))

    async def delete(self, dataset_id: str) -> None:
        await self._client._call(self._delete(dataset_id))


class _TasksBase(_Resource):
    def _list(self) -> _Req[list[TaskInfo]]:
        return _Req("GET", "/v1/tasks", list[TaskInfo])


class Tasks(_TasksBase):
    """`client.tasks`: the registered task adapters and the JSON schema of their parameters."""
    _client: Client


    def list(self) -> builtins.list[TaskInfo]:
        return self._client._call(self._list())


class AsyncTasks(_TasksBase):
    _client: AsyncClient

    async def list(self) -> builtins.list[TaskInfo]:
        return await self._client._call(self._list())


class _WorkersBase(_Resource):
    def _list(self, status: WorkerStatus | str | None, job_id: str | None, limit: int,
              offset: int) -> _Req[Page[WorkerRead]]:
        return _Req("GET", "/v1/workers", Page[WorkerRead],
                    params=_params(status=status, job_id=job_id, limit=limit, offset=offset))

    def _get(self, worker_id: str) -> _Req[WorkerRead]:
        return _Req("GET", f"/v1/workers/{_seg(worker_id, 'worker_id')}", WorkerRead)

    def _audits(self, worker_id: str, passed: bool | None, limit: int) -> _Req[list[AuditRead]]:
        return _Req("GET", f"/v1/workers/{_seg(worker_id, 'worker_id')}/audits", list[AuditRead],
                    params=_params(passed=passed, limit=limit))


class Workers(_WorkersBase):
    """`client.workers`: the workers on your jobs (a provider sees its own; an admin sees all)."""
    _client: Client


    def list(self, *, status: WorkerStatus | str | None = None, job_id: str | None = None, limit: int = 100,
             offset: int = 0) -> Page[WorkerRead]:
        return self._client._call(self._list(status, job_id, limit, offset))

    def get(self, worker_id: str) -> WorkerRead:
        """A worker, with its trust state (`trust`, `trust_reason`, `quarantined_until`)."""
        return self._client._call(self._get(worker_id))

    def audits(self, worker_id: str, *, passed: bool | None = None, limit: int = 100) -> builtins.list[AuditRead]:
        """The evidence behind a worker's trust, newest first (the worker, its provider and admins)."""
        return self._client._call(self._audits(worker_id, passed, limit))


class AsyncWorkers(_WorkersBase):
    _client: AsyncClient

    async def list(self, *, status: WorkerStatus | str | None = None, job_id: str | None = None,
                   limit: int = 100, offset: int = 0) -> Page[WorkerRead]:
        return await self._client._call(self._list(status, job_id, limit, offset))

    async def get(self, worker_id: str) -> WorkerRead:
        return await self._client._call(self._get(worker_id))

    async def audits(self, worker_id: str, *, passed: bool | None = None,
                     limit: int = 100) -> builtins.list[AuditRead]:
        return await self._client._call(self._audits(worker_id, passed, limit))


class _ProvidersBase(_Resource):
    def _create(self, name: str, contact: str | None) -> _Req[ProviderCreated]:
        body = _validated(ProviderCreate, {"name": name, "contact": contact})
        return _Req("POST", "/v1/providers", ProviderCreated, json=body.model_dump(mode="json"))

    def _me(self) -> _Req[ProviderRead]:
        return _Req("GET", "/v1/providers/me", ProviderRead)

    def _list(self) -> _Req[list[ProviderRead]]:
        return _Req("GET", "/v1/providers", list[ProviderRead])


class Providers(_ProvidersBase, _ProvidersMoney):
    """`client.providers`: sign providers up (admin key) and read the calling provider (provider token)."""
    _client: Client


    def create(self, name: str, *, contact: str | None = None) -> ProviderCreated:
        return self._client._call(self._create(name, contact))

    def me(self) -> ProviderRead:
        return self._client._call(self._me())

    def list(self) -> builtins.list[ProviderRead]:
        return self._client._call(self._list())


class AsyncProviders(_ProvidersBase, _AsyncProvidersMoney):
    _client: AsyncClient

    async def create(self, name: str, *, contact: str | None = None) -> ProviderCreated:
        return await self._client._call(self._create(name, contact))

    async def me(self) -> ProviderRead:
        return await self._client._call(self._me())

    async def list(self) -> builtins.list[ProviderRead]:
        return await self._client._call(self._list())


class _UsersBase(_Resource):
    def _me(self) -> _Req[UserRead]:
        return _Req("GET", "/v1/me", UserRead)

    def _create(self, name: str, role: Role | str) -> _Req[UserCreated]:
        body = _validated(UserCreate, {"name": name, "role": role})
        return _Req("POST", "/v1/users", UserCreated, json=body.model_dump(mode="json"))

    def _list(self) -> _Req[list[UserRead]]:
        return _Req("GET", "/v1/users", list[UserRead])

    def _create_key(self, user_id: str) -> _Req[ApiKeyCreated]:
        return _Req("POST", f"/v1/users/{_seg(user_id, 'user_id')}/keys", ApiKeyCreated)

    def _set_quotas(self, user_id: str, quotas: Mapping[str, Any]) -> _Req[UserRead]:
        body = _validated(Quotas, dict(quotas))
        return _Req("PUT", f"/v1/users/{_seg(user_id, 'user_id')}/quotas", UserRead, json=body.model_dump(mode="json"))


class Users(_UsersBase):
    """`client.users`: who am I; admins create users (each with an API key, shown once)."""
    _client: Client


    def me(self) -> UserRead:
        return self._client._call(self._me())

    def create(self, name: str, *, role: Role | str = Role.user) -> UserCreated:
        return self._client._call(self._create(name, role))

    def list(self) -> builtins.list[UserRead]:
        return self._client._call(self._list())

    def create_key(self, user_id: str) -> ApiKeyCreated:
        return self._client._call(self._create_key(user_id))

    def set_quotas(self, user_id: str, *, max_concurrent_jobs: int | None = None,
                   max_usd_per_day: float | None = None) -> UserRead:
        """(admin) The user's limits, None for none; jobs beyond them wait in the queue or pause."""
        quotas = {"max_concurrent_jobs": max_concurrent_jobs, "max_usd_per_day": max_usd_per_day}
        return self._client._call(self._set_quotas(user_id, quotas))


class AsyncUsers(_UsersBase):
    _client: AsyncClient

    async def me(self) -> UserRead:
        return await self._client._call(self._me())

    async def create(self, name: str, *, role: Role | str = Role.user) -> UserCreated:
        return await self._client._call(self._create(name, role))

    async def list(self) -> builtins.list[UserRead]:
        return await self._client._call(self._list())

    async def create_key(self, user_id: str) -> ApiKeyCreated:
        return await self._client._call(self._create_key(user_id))

    async def set_quotas(self, user_id: str, *, max_concurrent_jobs: int | None = None,
                         max_usd_per_day: float | None = None) -> UserRead:
        quotas = {"max_concurrent_jobs": max_concurrent_jobs, "max_usd_per_day": max_usd_per_day}
        return await self._client._call(self._set_quotas(user_id, quotas))


# --------------------------------------------------------------------------------------------------
# Checkpoints: a streamed tar, extracted as it arrives, checked against the version's manifest


class _CheckpointsBase(_Resource):
    def _versions(self, job_id: str) -> _Req[list[VersionRead]]:
        return _Req("GET", f"/v1/jobs/{_seg(job_id, 'job_id')}/versions", list[VersionRead])

    def _manifest(self, job_id: str, version: int) -> _Req[Manifest]:
        return _Req("GET", f"/v1/jobs/{_seg(job_id, 'job_id')}/versions/{int(version)}/manifest", Manifest)

    def _tar(self, job_id: str, version: int | None) -> _Req[None]:
        return _Req("GET", f"/v1/jobs/{_seg(job_id, 'job_id')}/checkpoint", None,
                    params=_params(version=version), headers={"Accept": "application/x-tar"})


class Checkpoints(_CheckpointsBase):
    """`client.checkpoints`: a job's published weight versions, downloadable as HF model folders."""
    _client: Client


    def versions(self, job_id: str) -> list[VersionRead]:
        return self._client._call(self._versions(job_id))

    def manifest(self, job_id: str, version: int) -> Manifest:
        return self._client._call(self._manifest(job_id, version))

    def download(self, job_id: str, dest_dir: str | os.PathLike[str], *, version: int | None = None,
                 overwrite: bool = False) -> Path:
        """Download a version (default: the final checkpoint, else the latest) into `dest_dir`.

        The folder appears complete or not at all: files are extracted next to it and moved into place
        last. Entries that would escape the folder, links and devices are refused (`CheckpointError`),
        and every file is checked against the manifest's size and sha256. `dest_dir` must not exist or
        be empty unless `overwrite` is true.
        """
        dest = _check_dest(Path(dest_dir), overwrite)
        response = self._client._send(self._tar(job_id, version), stream=True)
        try:
            chosen = version if version is not None else _version_of(response)
            manifest = self.manifest(job_id, chosen) if chosen is not None else None
            with _Staging(dest, overwrite) as staging, _TarSink(staging.path, manifest) as sink:
                try:
                    for block in response.iter_bytes():
                        sink.feed(block)
                except httpx.TransportError as exc:
                    raise _transport_error(exc, response.request) from exc
                sink.finish()
                staging.commit()
        finally:
            response.close()
        return dest


class AsyncCheckpoints(_CheckpointsBase):
    _client: AsyncClient

    async def versions(self, job_id: str) -> list[VersionRead]:
        return await self._client._call(self._versions(job_id))

    async def manifest(self, job_id: str, version: int) -> Manifest:
        return await self._client._call(self._manifest(job_id, version))

    async def download(self, job_id: str, dest_dir: str | os.PathLike[str], *, version: int | None = None,
                       overwrite: bool = False) -> Path:
        dest = _check_dest(Path(dest_dir), overwrite)
        response = await self._client._send(self._tar(job_id, version), stream=True)
        try:
            chosen = version if version is not None else _version_of(response)
            manifest = await self.manifest(job_id, chosen) if chosen is not None else None
            with _Staging(dest, overwrite) as staging, _TarSink(staging.path, manifest) as sink:
                try:
                    async for block in response.aiter_bytes():
                        sink.feed(block)
                except httpx.TransportError as exc:
                    raise _transport_error(exc, response.request) from exc
                sink.finish()
                staging.commit()
        finally:
            await response.aclose()
        return dest


def _version_of(response: httpx.Response) -> int | None:
    """The version the server chose, from `Content-Disposition: attachment; filename="<job>-v<N>.tar"`."""
    match = re.search(r'-v(\d+)\.tar"?\s*$', response.headers.get("content-disposition", ""))
    return int(match.group(1)) if match else None


def _check_dest(dest: Path, overwrite: bool) -> Path:
    if dest.exists():
        if not dest.is_dir():
            raise errors.CheckpointError(f"{dest} exists and is not a folder")
        if not overwrite and any(dest.iterdir()):
            raise errors.CheckpointError(f"{dest} is not empty; pass overwrite=True (--overwrite) to replace")
    return dest


class _Staging:
    """A fresh folder beside `dest`; `commit()` moves it into place, anything else removes it."""

    def __init__(self, dest: Path, overwrite: bool) -> None:
        self.dest, self.overwrite = dest, overwrite
        self.path = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> _Staging:
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self.path.mkdir()
        return self

    def commit(self) -> None:
        old: Path | None = None
        if self.dest.exists():
            _check_dest(self.dest, self.overwrite)
            old = self.dest.parent / f".{self.dest.name}.old-{uuid.uuid4().hex[:8]}"
            self.dest.rename(old)
        self.path.rename(self.dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.path.exists():
            shutil.rmtree(self.path, ignore_errors=True)


_BLOCK = tarfile.BLOCKSIZE
_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)


def _safe_relpath(name: str) -> str:
    """The member's path relative to the folder, or CheckpointError if it could land outside it."""
    if not name or "\0" in name or "\\" in name or name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise errors.CheckpointError(f"refusing checkpoint entry {name!r}: absolute or invalid path")
    parts = [p for p in PurePosixPath(name).parts if p != "."]
    if not parts or ".." in parts:
        raise errors.CheckpointError(f"refusing checkpoint entry {name!r}: it would escape the folder")
    return "/".join(parts)


class _TarSink:
    """A push-fed tar reader that writes only plain files and folders, inside `root`, as bytes arrive.

    Push-fed so the same code serves the sync and the async download without buffering the tar.
    Understands ustar, pax (`x`/`g`) and GNU long-name headers; refuses links and devices.
    """

    def __init__(self, root: Path, manifest: Manifest | None) -> None:
        self.root = root
        self.real_root = os.path.realpath(root)
        self.expected = {f.path: f for f in manifest.files} if manifest is not None else None
        self.buf = bytearray()
        self.done = False
        self.skip = 0
        self.meta: tuple[str, int] | None = None  # (header kind, size) of a pax/long-name body being read
        self.pax: dict[str, str] = {}
        self.long_name: str | None = None
        self.file: Any = None
        self.file_left = 0
        self.file_path = ""
        self.hasher: Any = None
        self.written: dict[str, str] = {}

    def feed(self, data: bytes) -> None:
        self.buf += data
        while self._step():
            pass

    def _step(self) -> bool:
        """Consume what can be consumed now; False when more bytes are needed."""
        if self.file is not None:
            return self._write_file()
        if self.skip:
            n = min(self.skip, len(self.buf))
            del self.buf[:n]
            self.skip -= n
            return n > 0
        if self.meta is not None:
            return self._read_meta()
        if self.done:
            if self.buf.strip(b"\0"):
                raise errors.CheckpointError("checkpoint tar has data after its end marker")
            self.buf.clear()
            return False
        if len(self.buf) < _BLOCK:
            return False
        block = bytes(self.buf[:_BLOCK])
        del self.buf[:_BLOCK]
        if block == b"\0" * _BLOCK:
            self.done = True
            return True
        self._header(block)
        return True

    def _header(self, block: bytes) -> None:
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            raise errors.CheckpointError(f"checkpoint tar is corrupt: {exc}") from None
        if info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME):
            if info.size > 1 << 20:
                raise errors.CheckpointError("checkpoint tar has an oversized metadata header")
            self.meta = (info.type.decode(), info.size)
            return
        name = self.pax.pop("path", None) or self.long_name or info.name
        size = int(self.pax.pop("size", info.size))
        self.pax, self.long_name = {}, None
        rel = _safe_relpath(name)
        if info.type == tarfile.DIRTYPE:
            self._target(rel).mkdir(parents=True, exist_ok=True)
            self.skip = _padded(size)
        elif info.type in _FILE_TYPES:
            self._open(rel, size)
        else:
            kind = {tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hard link"}.get(info.type, "special file")
            raise errors.CheckpointError(f"refusing checkpoint entry {name!r}: a {kind}, not a plain file")

    def _read_meta(self) -> bool:
        assert self.meta is not None
        kind, size = self.meta
        if len(self.buf) < _padded(size):
            return False
        body = bytes(self.buf[:size])
        del self.buf[:_padded(size)]
        self.meta = None
        if kind == tarfile.GNUTYPE_LONGNAME.decode():
            self.long_name = body.rstrip(b"\0").decode("utf-8", "surrogateescape")
        elif kind == tarfile.XHDTYPE.decode():
            self.pax = _pax_records(body)
        return True  # a global pax header (g) carries nothing we use

    def _target(self, rel: str) -> Path:
        target = self.root / rel
        real = os.path.realpath(target)
        if os.path.commonpath([real, self.real_root]) != self.real_root:
            raise errors.CheckpointError(f"refusing checkpoint entry {rel!r}: it would escape the folder")
        return target

    def _open(self, rel: str, size: int) -> None:
        if self.expected is not None:
            info = self.expected.get(rel)
            if info is None:
                raise errors.CheckpointError(f"checkpoint entry {rel!r} is not in the version's manifest")
            if info.size != size:
                raise errors.CheckpointError(
                    f"checkpoint entry {rel!r} has {size} bytes, the manifest says {info.size}")
        if rel in self.written:
            raise errors.CheckpointError(f"checkpoint has {rel!r} twice")
        target = self._target(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(target, "xb")  # noqa: SIM115 - closed in _finish_file; "x" never follows a planted link
        self.file_left, self.file_path, self.hasher = size, rel, hashlib.sha256()
        self.skip = 0
        if size == 0:
            self._finish_file()

    def _write_file(self) -> bool:
        n = min(self.file_left, len(self.buf))
        if n == 0:
            return False
        piece = bytes(self.buf[:n])
        del self.buf[:n]
        self.file.write(piece)
        self.hasher.update(piece)
        self.file_left -= n
        if self.file_left == 0:
            self._finish_file()
        return True

    def _finish_file(self) -> None:
        size = self.file.tell()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.file = None
        digest = self.hasher.hexdigest()
        if self.expected is not None and self.expected[self.file_path].sha256 != digest:
            raise errors.CheckpointError(
                f"checkpoint file {self.file_path!r} does not match the manifest's sha256")
        self.written[self.file_path] = digest
        self.skip = _padded(size) - size

    def __enter__(self) -> _TarSink:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.file is not None:  # a failed download: the staging folder is removed next
            self.file.close()
            self.file = None

    def finish(self) -> None:
        """The stream ended: check that the tar was complete and every manifest file arrived."""
        if self.file is not None:
            raise errors.CheckpointError(f"checkpoint download ended inside {self.file_path!r}")
        if not self.done:
            raise errors.CheckpointError("checkpoint download ended before the end of the tar")
        if self.expected is not None:
            missing = sorted(set(self.expected) - set(self.written))
            if missing:
                raise errors.CheckpointError(f"checkpoint is missing {', '.join(missing[:5])}")
        if not self.written:
            raise errors.CheckpointError("checkpoint has no files")


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def _pax_records(body: bytes) -> dict[str, str]:
    """Parse pax extended-header records: `<len> <key>=<value>\\n`, len counting the whole record."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(body):
        space = body.find(b" ", pos)
        if space < 0 or not body[pos:space].isdigit():
            raise errors.CheckpointError("checkpoint tar has a corrupt pax header")
        length = int(body[pos:space])
        record = body[space + 1:pos + length]
        if length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise errors.CheckpointError("checkpoint tar has a corrupt pax header")
        key, _, value = record[:-1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out
