"""The learner's HTTP client for the control plane: the HTTP implementation of its rollout source and
weight sink (learner/sources.py), and the rest of what a learner asks of the control plane. Every
learner call is safe to repeat (claims not committed by a step are released, step reports and chunk
uploads are idempotent), so `echo2.transport` retries transport errors and 5xx answers with backoff
for `give_up_after_s`: a control-plane restart is survived."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, TypeVar

import httpx
from echo2.deltas import apply_onto
from echo2.protocol import (
    AuditsRecorded,
    AuditVerdicts,
    EvalPrompt,
    EvalRead,
    EvalReport,
    FileRef,
    Form,
    JobRead,
    LearnerBatch,
    LearnerClaim,
    LearnerFinish,
    LearnerHeartbeat,
    LearnerStartReply,
    Manifest,
    Probe,
    ReplayStep,
    StepAck,
    StepReport,
    VersionPublish,
    VersionRead,
)
from echo2.snapshots import assemble, is_complete, iter_stream
from echo2.transport import Call, RetryPolicy, Transport
from pydantic import BaseModel

T = TypeVar("T", bound=BaseModel)
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class ControlPlane:
    def __init__(self, base_url: str, token: str, job_id: str, *, give_up_after_s: float = 300.0) -> None:
        self.job_id = job_id
        self.prefix = f"/v1/jobs/{job_id}"
        self.give_up_after_s = give_up_after_s
        # Bounded by time, not by count: the control plane may take a while to come back.
        policy = RetryPolicy(max_retries=1_000, max_delay=5.0, statuses=RETRY_STATUSES, retry_conflicts=False,
                             max_retry_after=math.inf, give_up_after=give_up_after_s)
        self._http = Transport(base_url.rstrip("/"), headers={"Authorization": f"Bearer {token}"},
                               timeout=httpx.Timeout(60.0, connect=10.0), policy=policy)

    def close(self) -> None:
        self._http.close()

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self._http.send(Call(method, path, replay=True, **kwargs))

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

    def report_audits(self, verdicts: AuditVerdicts) -> AuditsRecorded:
        return self._post("/learner/audits", verdicts, AuditsRecorded)

    def heartbeat(self, beat: LearnerHeartbeat) -> StepAck:
        return self._post("/learner/heartbeat", beat, StepAck)

    def eval_prompts(self) -> list[EvalPrompt]:
        return [EvalPrompt.model_validate(p) for p in self._send("GET", f"{self.prefix}/learner/eval-prompts").json()]

    def report_eval(self, report: EvalReport) -> EvalRead:
        return self._post("/learner/evals", report, EvalRead)

    def finish(self, finish: LearnerFinish) -> JobRead:
        return self._post("/learner/finish", finish, JobRead)

    def publish(self, forms: list[tuple[Path, Manifest]], probes: list[Probe] | None = None) -> VersionRead | None:
        """Upload every chunk of each form of a version (full and/or delta: the manifest says which, and the
        folder holds its files), then publish them together with `probes`. Returns None if this version was
        already published (a retried publish whose first answer was lost)."""
        v = forms[0][1].version
        latest = self.latest_version()
        if latest is not None and latest >= v:
            return None
        for folder, manifest in forms:
            self._upload_chunks(folder, manifest, self._form_path(v, manifest.form))
        body = VersionPublish(full=next((m for _, m in forms if m.form is Form.full), None),
                              delta=next((m for _, m in forms if m.form is Form.delta), None), probes=probes or [])
        return self._post("/versions", body, VersionRead)

    def upload_checkpoint(self, folder: Path, manifest: Manifest) -> None:
        """Store a learner checkpoint folder through the control plane (chunks, then the manifest)."""
        self._upload_chunks(folder, manifest, f"{self.prefix}/learner/checkpoints/{manifest.step}")
        self._post("/learner/checkpoints", manifest, Manifest)

    def fetch_checkpoint(self, out: Path) -> Path:
        """The newest learner checkpoint stored through the control plane, rebuilt and checked in `out`."""
        manifest = Manifest.model_validate(self._send("GET", f"{self.prefix}/learner/checkpoints/latest").json())
        base = f"{self.prefix}/learner/checkpoints/{manifest.step}"
        return assemble(manifest, lambda i: self._send("GET", f"{base}/chunks/{i}").content, out)

    def version_files(self, version: int) -> list[FileRef]:
        """The model files a published version stands for, whichever form it was published in."""
        info = next(v for v in self.versions() if v.version == version)
        return self._manifest(version, Form.full if info.total_size is not None else Form.delta).target_files()

    def committed_step(self, step: int) -> ReplayStep:
        return ReplayStep.model_validate(self._send("GET", f"{self.prefix}/learner/steps/{step}").json())

    def _upload_chunks(self, folder: Path, manifest: Manifest, base: str) -> None:
        for info, data in zip(manifest.chunks, iter_stream(folder, manifest.files, manifest.chunk_size), strict=True):
            headers = {"X-Echo2-Sha256": info.sha256, "Content-Type": "application/octet-stream"}
            self._send("PUT", f"{base}/chunks/{info.index}", content=data, headers=headers)

    def fetch_version(self, version: int, out: Path) -> Path:
        """A published version's model folder in `out`: downloaded whole when it was published in full,
        else rebuilt from the newest keyframe before it and the deltas after (every chunk and every rebuilt
        file checked against its manifest)."""
        if is_complete(out):
            return out
        published = {v.version: v for v in self.versions()}
        chain = [version]
        while published[chain[-1]].total_size is None:
            base = published[chain[-1]].delta_base
            assert base is not None, f"version {chain[-1]} has neither a full form nor a delta"
            chain.append(base)
        folder = self._download(chain[-1], Form.full, out if len(chain) == 1 else out.with_name(f"{out.name}.base"))
        for v in reversed(chain[:-1]):
            manifest = self._manifest(v, Form.delta)
            payload = self._download(v, Form.delta, out.with_name(f"{out.name}.d{v}"), manifest)
            folder = apply_onto(folder, manifest, payload, out.with_name(f"{out.name}.v{v}"))
        return folder if folder == out else folder.rename(out)

    def _download(self, version: int, form: Form, out: Path, manifest: Manifest | None = None) -> Path:
        manifest = manifest or self._manifest(version, form)
        base = self._form_path(version, form)
        return assemble(manifest, lambda i: self._send("GET", f"{base}/chunks/{i}").content, out)

    def _manifest(self, version: int, form: Form) -> Manifest:
        return Manifest.model_validate(self._send("GET", f"{self._form_path(version, form)}/manifest").json())

    def _form_path(self, version: int, form: Form) -> str:
        return f"{self.prefix}/versions/{version}" + ("/delta" if form is Form.delta else "")

    def versions(self) -> list[VersionRead]:
        return [VersionRead.model_validate(v) for v in self._send("GET", f"{self.prefix}/versions").json()]

    def latest_version(self) -> int | None:
        versions = self.versions()
        return versions[-1].version if versions else None
