"""A rollout producer for learner tests: the real transformers backend generating from versions fetched
over HTTP, leasing and submitting through the real API, proving it holds each version as a worker does
(echo2.possession). `lag` makes it deliberately hold a version up to `lag` steps older than the newest
(still admissible), to exercise bounded staleness."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from echo2.possession import answer
from echo2.prompting import encode_prompt
from echo2.protocol import FileRef, HeartbeatReply, LeaseRead, Manifest, Proof
from echo2.seeds import sample_seed
from echo2.snapshots import assemble
from echo2_worker.backends.base import GenRequest
from echo2_worker.backends.transformers_backend import TransformersBackend
from transformers import AutoModelForCausalLM, AutoTokenizer

# Resolved here, once: transformers' lazy attribute imports race when several drivers load at once.
_LOADERS = (AutoModelForCausalLM, AutoTokenizer)


class RolloutDriver:
    def __init__(self, base_url: str, worker_id: str, token: str, work_dir: Path, lag: int = 0,
                 prompts_per_lease: int = 8, forge: Callable[[list[dict[str, Any]]], None] | None = None) -> None:
        self.http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        self.worker_id, self.work_dir, self.lag, self.per_lease = worker_id, work_dir, lag, prompts_per_lease
        self.forge = forge  # an attacker's edit of the groups before they are submitted
        self.results: list[dict[str, Any]] = []  # the control plane's answer to every group submitted
        self.backend = TransformersBackend(device="cpu")
        self.tokenizer: Any = None
        self.held: int | None = None
        self.files: list[FileRef] = []  # of the held version, for possession challenges
        self.proofs: list[Proof] = []  # answers to the last reply's challenges, sent with the next heartbeat
        self.versions_used: list[int] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> RolloutDriver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        self.backend.close()
        self.http.close()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._iteration()
                except httpx.HTTPStatusError as exc:
                    if exc.response.status_code not in (403, 404, 409, 410):
                        raise
                    time.sleep(0.1)  # the job moved on (finished, our version went stale or was deleted)
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def _iteration(self) -> None:
        proofs = [p.model_dump() for p in self.proofs]
        reply = HeartbeatReply.model_validate(self._post(f"/v1/workers/{self.worker_id}/heartbeat",
                                                         {"version_held": self.held, "proofs": proofs}))
        if reply.desired.value != "active" or reply.assignment is None:
            time.sleep(0.2)
            return
        a = reply.assignment
        self.proofs = [answer(self.work_dir / f"v{c.version}", self.files, c) for c in a.challenges
                       if c.version == self.held]
        if a.version < a.min_version:  # the next version is still being published
            time.sleep(0.05)
            return
        self._hold(a.job_id, max(a.min_version, a.version - self.lag))
        self._one_lease(a.job_id)

    def _hold(self, job_id: str, version: int) -> None:
        if self.held is not None and self.held >= version:
            return
        manifest = Manifest.model_validate(self._get(f"/v1/jobs/{job_id}/versions/{version}/manifest"))
        folder = assemble(manifest, lambda i: self.http.get(
            f"/v1/jobs/{job_id}/versions/{version}/chunks/{i}").raise_for_status().content,
            self.work_dir / f"v{version}")
        if self.held is None:
            self.backend.load(folder)
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
        else:
            self.backend.reload(folder)
        self.held, self.files = version, manifest.target_files()

    def _one_lease(self, job_id: str) -> None:
        r = self.http.post("/v1/leases", json={"job_id": job_id, "max_prompts": self.per_lease, "version": self.held})
        if r.status_code == 409:
            time.sleep(0.1)  # no prompts free, or our version just became too stale
            return
        lease = LeaseRead.model_validate(r.raise_for_status().json())
        s = lease.sampling
        requests = [GenRequest(prompt_token_ids=encode_prompt(self.tokenizer, p.text), n=s.group_size,
                               seeds=[sample_seed(p.seed, k) for k in range(s.group_size)],
                               max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p)
                    for p in lease.prompts]
        groups = [{"prompt_id": p.prompt_id, "version": lease.version, "prompt_token_ids": req.prompt_token_ids,
                   "samples": [{"token_ids": x.token_ids, "logprobs": x.logprobs, "text": x.text,
                                "finish_reason": x.finish_reason} for x in out]}
                  for p, req, out in zip(lease.prompts, requests, self.backend.generate(requests), strict=True)]
        if self.forge is not None:
            self.forge(groups)
        self.results += self._post(f"/v1/leases/{lease.id}/rollouts", {"groups": groups})["results"]
        self.versions_used.append(lease.version)

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        return self.http.post(path, json=body).raise_for_status().json()

    def _get(self, path: str) -> Any:
        return self.http.get(path).raise_for_status().json()
