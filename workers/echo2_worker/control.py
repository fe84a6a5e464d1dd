"""The worker's side of the control-plane API: register, heartbeat, leases, rollouts, manifests.

Requests are retried a few times with bounded exponential backoff (honouring Retry-After) on
connection errors and 502/503/504/429; after that the caller's loop backs off and tries again, so a
control plane that restarts is survived. A POST is replayed after a failure that may have reached the
server only when replaying cannot act twice (heartbeats, renew/complete/release, and rollout
submission, which the server treats as idempotent per (lease, prompt)); a lease request is replayed
only when it never left this machine. Errors are the SDK's classes (`echo2.errors`).
"""

from __future__ import annotations

import random
import time
from typing import Any, TypeVar

import httpx
from echo2 import errors
from echo2._retry import NOT_SENT, retry_after
from echo2.protocol import (
    EpisodeReplies,
    EpisodeReply,
    EpisodeStep,
    EpisodeTurns,
    Heartbeat,
    HeartbeatReply,
    LeaseRead,
    LeaseRequest,
    Manifest,
    RolloutSubmit,
    RolloutSubmitResult,
    VersionNotice,
    WorkerRead,
    WorkerRegister,
    WorkerRegistered,
)
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)
RETRY_STATUS = frozenset({429, 502, 503, 504})
USER_AGENT = "echo2-worker/0.1.0"
EPISODE_TIMEOUT_S = 90.0


class ControlPlane:
    def __init__(self, server_url: str, token: str | None = None, *, timeout: float = 30.0, max_retries: int = 3,
                 max_delay: float = 8.0) -> None:
        self.server_url = server_url.rstrip("/")
        self.token = token
        self.max_retries = max_retries
        self.max_delay = max_delay
        self._http = httpx.Client(base_url=self.server_url, timeout=httpx.Timeout(timeout, connect=10.0),
                                  headers={"User-Agent": USER_AGENT, "Accept": "application/json"})

    def close(self) -> None:
        self._http.close()

    # -- fleet -----------------------------------------------------------------------------------

    def register(self, provider_token: str, body: WorkerRegister) -> WorkerRegistered:
        # Not replayed once sent: a replay could register the machine twice.
        return self._call("POST", "/v1/workers", WorkerRegistered, body, token=provider_token, replay=False)

    def heartbeat(self, worker_id: str, body: Heartbeat) -> HeartbeatReply:
        return self._call("POST", f"/v1/workers/{worker_id}/heartbeat", HeartbeatReply, body)

    def deregister(self, worker_id: str) -> None:
        self._call("DELETE", f"/v1/workers/{worker_id}", None)

    def get_worker(self, worker_id: str) -> WorkerRead:
        return self._call("GET", f"/v1/workers/{worker_id}", WorkerRead)

    def manifest(self, url: str) -> Manifest:
        return self._call("GET", url, Manifest)

    def wait_for_version(self, job_id: str, after: int, timeout_s: float) -> VersionNotice:
        """Long-poll: returns when a version newer than `after` is announced, or after `timeout_s`."""
        return self._call("GET", f"/v1/jobs/{job_id}/versions/next?after={int(after)}&timeout_s={timeout_s:g}",
                          VersionNotice, timeout=timeout_s + 30)

    # -- leases and rollouts ---------------------------------------------------------------------

    def lease(self, body: LeaseRequest) -> LeaseRead:
        # Not replayed once sent: a lost answer would leave a lease we do not know about (it expires).
        return self._call("POST", "/v1/leases", LeaseRead, body, replay=False, retry_conflict=False)

    def renew(self, lease_id: str) -> LeaseRead:
        return self._call("POST", f"/v1/leases/{lease_id}/renew", LeaseRead)

    def complete(self, lease_id: str) -> LeaseRead:
        return self._call("POST", f"/v1/leases/{lease_id}/complete", LeaseRead)

    def release(self, lease_id: str) -> LeaseRead:
        return self._call("POST", f"/v1/leases/{lease_id}/release", LeaseRead)

    def submit(self, lease_id: str, body: RolloutSubmit) -> RolloutSubmitResult:
        return self._call("POST", f"/v1/leases/{lease_id}/rollouts", RolloutSubmitResult, body)

    def play_turns(self, lease_id: str, steps: list[EpisodeStep]) -> list[EpisodeReply]:
        # Replayed safely: the server answers a retried turn as it answered it the first time. It may take
        # its environments up to 60 s (api/services/episodes.py ENV_DEADLINE_S): wait longer than that.
        return self._call("POST", f"/v1/leases/{lease_id}/episodes", EpisodeReplies, EpisodeTurns(steps=steps),
                          timeout=EPISODE_TIMEOUT_S).replies

    # -- plumbing --------------------------------------------------------------------------------

    def _call(self, method: str, path: str, cast: type[M] | None, body: BaseModel | None = None, *,
              token: str | None = None, replay: bool = True, retry_conflict: bool = False,
              timeout: float | None = None) -> Any:
        token = token or self.token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        content = body.model_dump_json(exclude_unset=False).encode() if body is not None else None
        if content is not None:
            headers["Content-Type"] = "application/json"
        attempt = 0
        while True:
            try:
                response = self._http.request(method, path, content=content, headers=headers,
                                              **({"timeout": timeout} if timeout is not None else {}))
            except httpx.TransportError as exc:
                if attempt < self.max_retries and (replay or isinstance(exc, NOT_SENT)):
                    self._sleep(attempt, None)
                    attempt += 1
                    continue
                where = f"{method} {self.server_url if path.startswith('/') else ''}{path}"
                raise errors.ConnectionError(f"could not reach the Echo2 server: {where}: "
                                             f"{type(exc).__name__}") from exc
            if response.is_success:
                return self._parse(response, cast, method, path)
            if attempt < self.max_retries and response.status_code in RETRY_STATUS:
                self._sleep(attempt, response)
                attempt += 1
                continue
            raise errors.error_from_response(response, retry_after(response.headers))

    def _sleep(self, attempt: int, response: httpx.Response | None) -> None:
        after = retry_after(response.headers) if response is not None else None
        delay = after if after is not None else min(self.max_delay, 0.5 * 2**attempt) * (0.75 + 0.5 * random.random())
        time.sleep(min(delay, 60.0))

    @staticmethod
    def _parse(response: httpx.Response, cast: type[M] | None, method: str, path: str) -> Any:
        if cast is None:
            return None
        try:
            return cast.model_validate_json(response.content)
        except ValidationError as exc:
            raise errors.UnexpectedResponseError(
                f"{method} {path}: answer is not a {cast.__name__} ({exc.errors()[0]['msg']}); "
                "is --server an Echo2 control plane of a compatible version?", response=response) from None
