"""The worker's side of the control-plane API: register, heartbeat, leases, rollouts, manifests.

Requests go through `echo2.transport`: retried a few times with bounded exponential backoff (honouring
Retry-After) on connection errors and 502/503/504/429; after that the caller's loop backs off and tries
again, so a control plane that restarts is survived. A POST is replayed after a failure that may have
reached the server only when replaying cannot act twice (heartbeats, renew/complete/release, and rollout
submission, which the server treats as idempotent per (lease, prompt)); a lease request is replayed
only when it never left this machine. Errors are the SDK's classes (`echo2.errors`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, TypeVar

import httpx
from echo2 import errors
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
    PlacementLine,
    PlatformVersion,
    ProviderRead,
    RolloutSubmit,
    RolloutSubmitResult,
    VersionNotice,
    WorkerRead,
    WorkerRegister,
    WorkerRegistered,
)
from echo2.transport import Call, RetryPolicy, Transport
from pydantic import BaseModel, RootModel, ValidationError

M = TypeVar("M", bound=BaseModel)
RETRY_STATUSES = frozenset({429, 502, 503, 504})
UNTIL_DEADLINE = 10**6  # retries of a call bounded by its give_up_after instead of a count
USER_AGENT = "echo2-worker/0.1.0"
EPISODE_TIMEOUT_S = 90.0


class _Placement(RootModel[list[PlacementLine]]):
    """GET /v1/workers/{id}/placement's answer."""


class ControlPlane:
    def __init__(self, server_url: str, token: str | None = None, *, timeout: float = 30.0, max_retries: int = 3,
                 max_delay: float = 8.0) -> None:
        self.server_url = server_url.rstrip("/")
        self.token = token
        # A longer Retry-After is waited for a minute, then the request tried again.
        self._policy = RetryPolicy(max_retries=max_retries, max_delay=max_delay, statuses=RETRY_STATUSES,
                                   retry_conflicts=False, clamp_retry_after=True)
        self._http = Transport(self.server_url, headers={"User-Agent": USER_AGENT, "Accept": "application/json"},
                               timeout=httpx.Timeout(timeout, connect=10.0), policy=self._policy)

    def close(self) -> None:
        self._http.close()

    # -- fleet -----------------------------------------------------------------------------------

    def register(self, provider_token: str, body: WorkerRegister) -> WorkerRegistered:
        # Not replayed once sent: a replay could register the machine twice.
        return self._call("POST", "/v1/workers", WorkerRegistered, body, token=provider_token, replay=False)

    def heartbeat(self, worker_id: str, body: Heartbeat, policy: RetryPolicy | None = None) -> HeartbeatReply:
        return self._call("POST", f"/v1/workers/{worker_id}/heartbeat", HeartbeatReply, body, policy=policy)

    def deregister(self, worker_id: str) -> None:
        self._call("DELETE", f"/v1/workers/{worker_id}", None)

    def provider(self, provider_token: str) -> ProviderRead:
        """The provider this token belongs to: a cheap check of the token before anything slow."""
        return self._call("GET", "/v1/providers/me", ProviderRead, token=provider_token)

    def platform_version(self) -> PlatformVersion:
        return self._call("GET", "/v1/version", PlatformVersion)

    def get_worker(self, worker_id: str, token: str | None = None) -> WorkerRead:
        return self._call("GET", f"/v1/workers/{worker_id}", WorkerRead, token=token)

    def placement(self, worker_id: str) -> list[PlacementLine]:
        """Why the scheduler has this worker where it is (its newest decision on each job weighed)."""
        return self._call("GET", f"/v1/workers/{worker_id}/placement", _Placement).root

    def manifest(self, url: str) -> Manifest:
        return self._call("GET", url, Manifest)

    def wait_for_version(self, job_id: str, after: int, timeout_s: float) -> VersionNotice:
        """Long-poll: returns when a version newer than `after` is announced, or after `timeout_s`."""
        return self._call("GET", f"/v1/jobs/{job_id}/versions/next?after={int(after)}&timeout_s={timeout_s:g}",
                          VersionNotice, timeout=timeout_s + 30)

    # -- leases and rollouts ---------------------------------------------------------------------

    def lease(self, body: LeaseRequest) -> LeaseRead:
        # Not replayed once sent: a lost answer would leave a lease we do not know about (it expires).
        return self._call("POST", "/v1/leases", LeaseRead, body, replay=False)

    def renew(self, lease_id: str) -> LeaseRead:
        return self._call("POST", f"/v1/leases/{lease_id}/renew", LeaseRead)

    def complete(self, lease_id: str) -> LeaseRead:
        return self._call("POST", f"/v1/leases/{lease_id}/complete", LeaseRead)

    def release(self, lease_id: str) -> LeaseRead:
        return self._call("POST", f"/v1/leases/{lease_id}/release", LeaseRead)

    def submit(self, lease_id: str, body: RolloutSubmit, give_up_after: float | None = None) -> RolloutSubmitResult:
        """Submitted groups are idempotent per prompt, so with `give_up_after` (the lease's time left) the call
        is retried on connection errors and 5xx until then: generated work is worth waiting for."""
        policy = None if give_up_after is None else replace(
            self._policy, max_retries=UNTIL_DEADLINE, give_up_after=give_up_after, statuses=RETRY_STATUSES | {500})
        return self._call("POST", f"/v1/leases/{lease_id}/rollouts", RolloutSubmitResult, body, policy=policy)

    def play_turns(self, lease_id: str, steps: list[EpisodeStep]) -> list[EpisodeReply]:
        # Replayed safely: the server answers a retried turn as it answered it the first time. It may take
        # its environments up to 60 s (api/services/episodes.py ENV_DEADLINE_S): wait longer than that. A
        # process busy with other workers' episodes answers 429 at once: ask again for as long.
        policy = replace(self._policy, max_retries=UNTIL_DEADLINE, give_up_after=EPISODE_TIMEOUT_S)
        return self._call("POST", f"/v1/leases/{lease_id}/episodes", EpisodeReplies, EpisodeTurns(steps=steps),
                          timeout=EPISODE_TIMEOUT_S, policy=policy).replies

    # -- plumbing --------------------------------------------------------------------------------

    def _call(self, method: str, path: str, cast: type[M] | None, body: BaseModel | None = None, *,
              token: str | None = None, replay: bool = True, timeout: float | None = None,
              policy: RetryPolicy | None = None) -> Any:
        token = token or self.token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        content = body.model_dump_json(exclude_unset=False).encode() if body is not None else None
        if content is not None:
            headers["Content-Type"] = "application/json"
        call = Call(method, path, content=content, headers=headers, timeout=timeout, replay=replay)
        return self._parse(self._http.send(call, policy=policy), cast, method, path)

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
