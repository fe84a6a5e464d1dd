"""Helpers that drive the real API the way each kind of caller would."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from echo2.deltas import Folder, build_delta, file_refs
from echo2.possession import draw_probes
from echo2.protocol import Manifest, Probe
from echo2.snapshots import build_manifest, iter_stream

from api.models import Job, Worker, utcnow
from api.services.fleet import assign
from api.settings import get_settings
from scheduler import hosts
from scheduler.reconcile import TickReport, tick

from .conftest import Api

DELTA_CHUNK = 4096
TEST_SLOTS = 8  # learner slots run_tick offers: more than any test starts jobs
SHA = "X-Echo2-Sha256"


def ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, f"{response.status_code}: {response.text}"
    return response.json() if response.content else None


def new_user(api: Api, name: str = "alice", role: str = "user") -> tuple[str, httpx.Client]:
    body = ok(api.admin.post("/v1/users", json={"name": name, "role": role}), 201)
    return body["user"]["id"], api.client(body["api_key"])


def new_provider(api: Api, name: str = "gpu-co") -> tuple[str, httpx.Client]:
    body = ok(api.admin.post("/v1/providers", json={"name": name}), 201)
    return body["provider"]["id"], api.client(body["token"])


def new_worker(api: Api, provider: httpx.Client, name: str = "w", **fields: Any) -> tuple[str, httpx.Client]:
    body = ok(provider.post("/v1/workers", json={"name": name, "vram_gb": 16, **fields}), 201)
    return body["worker"]["id"], api.client(body["token"])


def job_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "arith", "base_model": "echo2:tiny", "task": {"name": "arithmetic"},
        "grpo": {"group_size": 2, "prompts_per_step": 4}, "num_prompts": 40, "staleness": 1, "max_steps": 5,
    }
    spec.update(overrides)
    return spec


def new_job(user: httpx.Client, **overrides: Any) -> dict[str, Any]:
    return ok(user.post("/v1/jobs", json=job_spec(**overrides)), 201)


def learner_for(api: Api, job_id: str) -> httpx.Client:
    token = ok(api.admin.post(f"/v1/jobs/{job_id}/learner/token"), 201)["token"]
    return api.client(token)


def start_learner(api: Api, job_id: str) -> httpx.Client:
    """The job's learner client, after `learner/start` (the job is running, no version yet)."""
    learner = learner_for(api, job_id)
    ok(learner.post(f"/v1/jobs/{job_id}/learner/start"))
    return learner


def step_report(step: int, ids: list[str], **fields: Any) -> dict[str, Any]:
    """A learner step report for rollouts `ids` (each group rewarded [1, 0]); `fields` override."""
    return {"step": step, "rollout_ids": ids, "t_train_s": 0.1, "reward_mean": 0.5, "reward_std": 0.1,
            "loss": 0.2, "kl": 0.0, "clip_frac": 0.0, "staleness_hist": [len(ids)], "tokens": 12,
            "rewards": [{"rollout_id": i, "rewards": [1.0, 0.0]} for i in ids], **fields}


def publish(learner: httpx.Client, job_id: str, folder: Path, version: int, step: int,
            chunk_size: int = 64 * 1024, probes: bool = False) -> dict[str, Any]:
    """Publish `folder` in full; with `probes`, as the learner does (workers must prove they hold it)."""
    manifest = build_manifest(folder, version, step, chunk_size)
    return publish_forms(learner, job_id, [(folder, manifest)],
                         draw_probes(folder, manifest.target_files()) if probes else [])


def publish_forms(learner: httpx.Client, job_id: str, forms: list[tuple[Path, Manifest]],
                  probes: list[Probe] | None = None) -> dict[str, Any]:
    """Upload each form's chunks (a full folder, or a delta's payload folder), then publish them together."""
    body: dict[str, Any] = {"probes": [p.model_dump() for p in probes or []]}
    for folder, manifest in forms:
        base = f"/v1/jobs/{job_id}/versions/{manifest.version}" + ("/delta" if manifest.delta else "")
        for info, data in zip(manifest.chunks, iter_stream(folder, manifest.files, manifest.chunk_size), strict=True):
            r = learner.put(f"{base}/chunks/{info.index}", content=data,
                            headers={SHA: info.sha256, "Content-Type": "application/octet-stream"})
            assert r.status_code == 204, r.text
        body[manifest.form.value] = manifest.model_dump(mode="json")
    return ok(learner.post(f"/v1/jobs/{job_id}/versions", json=body), 201)


def version_folder(root: Path, version: int) -> Path:
    """Version v of a toy model: a float32 tensor of which version v changed 1 % of the elements."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 512)).astype("float32")
    for v in range(1, version + 1):
        changed = np.random.default_rng(v).choice(w.size, w.size // 100, replace=False)
        w.flat[changed] += 1e-3
    folder = root / f"v{version}"
    folder.mkdir(parents=True)
    save_file({"w": w}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "test"}')
    return folder


def forms(root: Path, version: int, full: bool = True, delta: bool = True) -> list[tuple[Path, Manifest]]:
    folder = version_folder(root, version)
    out = []
    if full:
        out.append((folder, build_manifest(folder, version, version, DELTA_CHUNK)))
    if delta:
        base = root / f"v{version - 1}"
        payload = root / f"d{version}"
        manifest = build_delta(Folder(version - 1, base, file_refs(base)), Folder(version, folder, file_refs(folder)),
                               payload, version, DELTA_CHUNK)
        assert manifest is not None
        out.append((payload, manifest))
    return out


def fake_model_folder(root: Path, seed: int = 0) -> Path:
    """A small folder shaped like an HF model (safetensors + config) for protocol tests."""
    import numpy as np
    from safetensors.numpy import save_file

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file({"w": rng.standard_normal((64, 512)).astype("float32")}, str(root / "model.safetensors"))
    (root / "config.json").write_text('{"model_type": "test"}')
    return root


def running_job(api: Api, user: httpx.Client, folder: Path, *, probes: bool = False,
                **overrides: Any) -> tuple[dict[str, Any], httpx.Client]:
    """A job whose learner has started and published version 0 (with `probes`, as the learner does)."""
    job = new_job(user, **overrides)
    learner = start_learner(api, job["id"])
    publish(learner, job["id"], folder, version=0, step=0, probes=probes)
    return job, learner


def activate(api: Api, worker_id: str, job_id: str) -> None:
    """What the scheduler does when it picks a worker for a job, and the worker fetching the versions
    published so far (a lease is granted only at a version the worker reported holding: see `hold`)."""
    with api.db.session() as s:
        worker, job = s.get(Worker, worker_id), s.get(Job, job_id)
        assert worker is not None and job is not None
        assign(s, worker, job, api.server.settings or get_settings())  # (None: the API runs in other processes)
        worker.versions_held = [] if job.version is None else list(range(job.version + 1))
        s.commit()


def hold(worker: httpx.Client, *versions: int) -> None:
    """The worker's heartbeat after fetching `versions` (a worker token lists only its own worker)."""
    worker_id = ok(worker.get("/v1/workers"))["items"][0]["id"]
    ok(worker.post(f"/v1/workers/{worker_id}/heartbeat", json={"versions_held": list(versions)}))


def group_body(prompt: dict[str, Any], version: int, group_size: int = 2) -> dict[str, Any]:
    """A well-formed group for a leased prompt. Samples differ (the door audits a group of identical ones whatever
    its sender's trust)."""
    samples = [{"token_ids": [5 + k, 6, 7], "logprobs": [-0.5, -1.0, -0.1], "text": "42", "finish_reason": "stop"}
               for k in range(group_size)]
    return {"prompt_id": prompt["prompt_id"], "version": version, "prompt_token_ids": [1, 2, 3], "samples": samples}


def submit_group(worker: httpx.Client, lease: dict[str, Any], prompt: dict[str, Any], version: int,
                 group_size: int = 2) -> httpx.Response:
    return worker.post(f"/v1/leases/{lease['id']}/rollouts",
                       json={"groups": [group_body(prompt, version, group_size)]})


@dataclass
class DrivenJob:
    """A job whose learner published v0, trained step 0 on a worker's rollouts, and published v1."""

    id: str
    folder: Path
    worker_id: str
    rollout_ids: list[str]
    learner: httpx.Client

    def finish(self) -> None:
        ok(self.learner.post(f"/v1/jobs/{self.id}/learner/finish",
                             json={"outcome": "succeeded", "final_version": 1}))


def drive_job(api: Api, job_id: str, folder: Path, **report: Any) -> DrivenJob:
    """Play the learner and one worker through step 0 of a queued job; `report` overrides step_report."""
    learner = start_learner(api, job_id)
    publish(learner, job_id, folder, version=0, step=0)
    _, provider = new_provider(api)
    worker_id, worker = new_worker(api, provider)
    activate(api, worker_id, job_id)
    lease = ok(worker.post("/v1/leases", json={"job_id": job_id, "max_prompts": 2, "version": 0}), 201)
    ids = [ok(submit_group(worker, lease, p, 0))["results"][0]["rollout_id"] for p in lease["prompts"]]
    batch = ok(learner.post(f"/v1/jobs/{job_id}/learner/claim", json={"step": 0, "max_groups": 10}))
    assert {g["rollout_id"] for g in batch["groups"]} == set(ids)
    ok(learner.post(f"/v1/jobs/{job_id}/learner/steps", json=step_report(0, ids, **report)))
    publish(learner, job_id, folder, version=1, step=1)
    return DrivenJob(job_id, folder, worker_id, ids, learner)


def run_tick(api: Api, now: Any = None, slots: int = TEST_SLOTS) -> tuple[TickReport, list[tuple[str, str]]]:
    """One reconcile tick of the real scheduler, with one learner host of `slots` registered as a live
    host registers itself; returns the tick's report and the learners it launched."""
    launched: list[tuple[str, str]] = []
    with api.db.session() as s:
        hosts.register(s, "test-learner-host", slots, now)
        s.commit()
    with api.db.session() as s:
        report = tick(s, api.server.settings, lambda job, token, _: launched.append((job, token)), now=now)
    return report, launched


def bill_past_budget(api: Api, job_id: str) -> None:
    """Two ticks a second apart with a live learner (so only the budget can stop the job): enough
    to exhaust the budget of a job created with a tiny budget and a high learner price."""
    now = utcnow()
    with api.db.session() as s:
        s.get(Job, job_id).learner_heartbeat_at = now
        s.commit()
    run_tick(api, now=now)
    run_tick(api, now=now + timedelta(seconds=1))


def paid_job(api: Api, folder: Path, workers: list[tuple[str, httpx.Client]],
             worker_price: float = 3600.0) -> tuple[str, httpx.Client]:
    """A job (its learner at $1/h) trained one step on a group from each worker, then billed over two
    seconds of ticks: an entry per worker and the learner's. Returns the job's id and its owner."""
    _, owner = new_user(api, "payer")
    job, learner = running_job(api, owner, folder, learner={"price_per_hour": 1.0})
    ids = []
    for wid, worker in workers:
        activate(api, wid, job["id"])
        lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}), 201)
        ids += [ok(submit_group(worker, lease, p, 0))["results"][0]["rollout_id"] for p in lease["prompts"]]
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 0, "max_groups": 10}))
    ok(learner.post(f"/v1/jobs/{job['id']}/learner/steps", json=step_report(0, ids)))
    now = utcnow()
    with api.db.session() as s:
        for wid, _ in workers:
            w = s.get_one(Worker, wid)
            w.status, w.desired, w.price_per_hour, w.activated_mu = "active", "active", worker_price, 1.0
        s.get_one(Job, job["id"]).learner_heartbeat_at = now
        s.commit()
    run_tick(api, now=now)
    run_tick(api, now=now + timedelta(seconds=2))
    return job["id"], owner


def traced_step(api: Api, model_dir: Path) -> tuple[str, list[str], httpx.Client, str]:
    """A job on the tiny model whose step 0 trained two groups of a worker, the first audited and traced (the
    learner's logprobs beside the worker's), the second with learner logprobs that do not fit; the worker paid.
    Returns (job id, rollout ids, the owner's client, the owner's key)."""
    _, alice = new_user(api)
    key = alice.headers["Authorization"].removeprefix("Bearer ")
    job, learner = running_job(api, alice, model_dir, staleness=1, max_steps=3, learner={"price_per_hour": 1.0},
                               grpo={"group_size": 2, "max_new_tokens": 3})
    jid = job["id"]
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider, name="traced-worker")
    activate(api, wid, jid)
    lease = ok(worker.post("/v1/leases", json={"job_id": jid, "max_prompts": 2, "version": 0}), 201)
    ids = []
    for p in lease["prompts"]:
        samples = [{"token_ids": [72, 15, 33], "logprobs": [-0.5, -1.0, -0.25], "finish_reason": "length"},
                   {"token_ids": [52, 0], "logprobs": [-0.1, -2.0], "finish_reason": "stop"}]  # 0: end of text
        group = {"prompt_id": p["prompt_id"], "version": 0, "prompt_token_ids": [1, 2, 3], "samples": samples}
        result = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))["results"][0]
        assert result["status"] == "accepted", result
        ids.append(result["rollout_id"])
    ok(learner.post(f"/v1/jobs/{jid}/learner/claim", json={"step": 0, "max_groups": 10}))
    report = step_report(0, ids, audits=[{"rollout_id": ids[0], "passed": True, "stats": {"tokens": 5.0}}])
    report["rewards"] = [{"rollout_id": ids[0], "rewards": [1.0, 0.0],
                          "learner_logprobs": [[-0.5, -0.75, -0.25], [-0.1, -1.5]]},
                         {"rollout_id": ids[1], "rewards": [0.0, 0.0],
                          "learner_logprobs": [[-0.5], [-0.1, -2.0]]}]  # does not fit: not kept
    ok(learner.post(f"/v1/jobs/{jid}/learner/steps", json=report))
    now = utcnow()
    with api.db.session() as s:  # the scheduler pays the worker for its trained groups
        w = s.get_one(Worker, wid)
        w.status, w.desired, w.price_per_hour, w.activated_mu = "active", "active", 3600.0, 1.0
        s.get_one(Job, jid).learner_heartbeat_at = now
        s.commit()
    run_tick(api, now=now)
    run_tick(api, now=now + timedelta(seconds=2))

    return jid, ids, alice, key
