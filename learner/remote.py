"""The learner's HTTP client for the control plane. Every learner call is safe to repeat (claims not
committed by a step are released, step reports and chunk uploads are idempotent), so transport
errors and 5xx answers are retried with backoff for a while: a control-plane restart is survived."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, TypeVar

import httpx
from echo2._retry import RetryPolicy
from echo2.errors import error_from_response
from echo2.protocol import (
    JobRead,
    LearnerBatch,
    LearnerClaim,
    LearnerFinish,
    LearnerHeartbeat,
    LearnerStartReply,
    Manifest,
    ReplayStep,
    StepAck,
    StepReport,
    VersionRead,
)
from echo2.snapshots import assemble, is_complete, iter_stream
from pydantic import BaseModel

log = logging.getLogger(__name__)
T = TypeVar("T", bound=BaseModel)
RETRY_STATUS = {429, 500, 502, 503, 504}


class ControlPlane:
    def __init__(self, base_url: str, token: str, job_id: str, *, give_up_after_s: float = 300.0) -> None:
        self.job_id = job_id
        self.prefix = f"/v1/jobs/{job_id}"
        self.give_up_after_s = give_up_after_s
        self._policy = RetryPolicy(max_retries=1_000, max_delay=5.0)
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=httpx.Timeout(60.0, connect=10.0),
                                  headers={"Authorization": f"Bearer {token}"})

    def close(self) -> None:
        self._http.close()

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        deadline, attempt = time.monotonic() + self.give_up_after_s, 0
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
                if response.status_code not in RETRY_STATUS:
                    break
                failure: str = f"HTTP {response.status_code}"
            except httpx.TransportError as exc:
                response, failure = None, f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                if response is not None:
                    break
                raise ConnectionError(f"control plane unreachable for {self.give_up_after_s:.0f}s: {failure}")
            log.warning("%s %s failed (%s); retrying", method, path, failure)
            time.sleep(self._policy.delay(attempt, response))
            attempt += 1
        if not response.is_success:
            raise error_from_response(response)
        return response

    def _post(self, path: str, body: BaseModel | None, reply: type[T]) -> T:
        data = body.model_dump(mode="json") if body is not None else None
        return reply.model_validate(self._send("POST", self.prefix + path, json=data).json())

    def start(self) -> LearnerStartReply:
        return self._post("/learner/start", None, LearnerStartReply)

    def claim(self, step: int, max_groups: int, wait_s: float = 0.0) -> LearnerBatch:
        body = LearnerClaim(step=step, max_groups=max_groups, wait_s=wait_s)
        return self._post("/learner/claim", body, LearnerBatch)

    def report(self, report: StepReport) -> StepAck:
        return self._post("/learner/steps", report, StepAck)

    def heartbeat(self, beat: LearnerHeartbeat) -> StepAck:
        return self._post("/learner/heartbeat", beat, StepAck)

    def finish(self, finish: LearnerFinish) -> JobRead:
        return self._post("/learner/finish", finish, JobRead)

    def publish(self, folder: Path, manifest: Manifest) -> VersionRead | None:
        """Upload every chunk, then the manifest. Returns None if this version was already published
        (a retried publish whose first answer was lost)."""
        v = manifest.version
        latest = self.latest_version()
        if latest is not None and latest >= v:
            return None
        self._upload_chunks(folder, manifest, f"{self.prefix}/versions/{v}")
        return self._post("/versions", manifest, VersionRead)

    def upload_checkpoint(self, folder: Path, manifest: Manifest) -> None:
        """Store a learner checkpoint folder through the control plane (chunks, then the manifest)."""
        self._upload_chunks(folder, manifest, f"{self.prefix}/learner/checkpoints/{manifest.step}")
        self._post("/learner/checkpoints", manifest, Manifest)

    def fetch_checkpoint(self, out: Path) -> Path:
        """The newest learner checkpoint stored through the control plane, rebuilt and checked in `out`."""
        manifest = Manifest.model_validate(self._send("GET", f"{self.prefix}/learner/checkpoints/latest").json())
        base = f"{self.prefix}/learner/checkpoints/{manifest.step}"
        return assemble(manifest, lambda i: self._send("GET", f"{base}/chunks/{i}").content, out)

    def manifest(self, version: int) -> Manifest:
        return Manifest.model_validate(self._send("GET", f"{self.prefix}/versions/{version}/manifest").json())

    def committed_step(self, step: int) -> ReplayStep:
        return ReplayStep.model_validate(self._send("GET", f"{self.prefix}/learner/steps/{step}").json())

    def _upload_chunks(self, folder: Path, manifest: Manifest, base: str) -> None:
        for info, data in zip(manifest.chunks, iter_stream(folder, manifest.files, manifest.chunk_size), strict=True):
            headers = {"X-Echo2-Sha256": info.sha256, "Content-Type": "application/octet-stream"}
            self._send("PUT", f"{base}/chunks/{info.index}", content=data, headers=headers)

    def fetch_version(self, version: int, out: Path) -> Path:
        """A published version rebuilt into `out` from its chunks, each checked against the manifest."""
        if is_complete(out):
            return out
        base = f"{self.prefix}/versions/{version}"
        manifest = Manifest.model_validate(self._send("GET", f"{base}/manifest").json())
        return assemble(manifest, lambda i: self._send("GET", f"{base}/chunks/{i}").content, out)

    def latest_version(self) -> int | None:
        versions = self._send("GET", f"{self.prefix}/versions").json()
        return versions[-1]["version"] if versions else None
