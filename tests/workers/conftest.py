"""Helpers for worker tests: a running job on the tiny model, a worker loop in a thread, a lying relay,
and nudged next versions. Everything talks to the real control plane over HTTP (the `api` fixture)."""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from echo2_worker.backends import create_backend
from echo2_worker.control import ControlPlane
from echo2_worker.loop import LoopOptions, Worker
from echo2_worker.progress import Stats
from echo2_worker.relay import RelayServer
from echo2_worker.store import VersionStore

from tests.conftest import Api
from tests.factories import activate, new_user, ok, running_job


@pytest.fixture(autouse=True)
def _trusted_workers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """No learner judges these tests' groups: a worker on probation would stop at pool.UNJUDGED groups waiting
    for their audit, before the versions the tests publish later. Trust is tested in tests/api."""
    if "api" in request.fixturenames:
        monkeypatch.setattr(request.getfixturevalue("api").server.settings, "probation_audits", 0)


# No learner trains these jobs, so the staleness contract's room ((S + 1) R groups ahead) must outlast each
# test's rollouts: R = 256.
JOB = {"grpo": {"group_size": 2, "prompts_per_step": 256, "max_new_tokens": 12}, "num_prompts": 400,
       "staleness": 1, "max_steps": 50}


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def rollouts(api: Api, job_id: str, status: str | None = None) -> list[dict[str, Any]]:
    items, offset = [], 0
    while True:
        params: dict[str, Any] = {"limit": 200, "offset": offset}
        if status:
            params["status"] = status
        page = ok(api.admin.get(f"/v1/jobs/{job_id}/rollouts", params=params))
        items += page["items"]
        if page["next_offset"] is None:
            return items
        offset = page["next_offset"]


def worker_row(api: Api, worker_id: str) -> dict[str, Any]:
    return ok(api.admin.get(f"/v1/workers/{worker_id}"))


@dataclass
class JobSetup:
    job: dict[str, Any]
    learner: httpx.Client
    provider: httpx.Client
    provider_token: str

    @property
    def id(self) -> str:
        return self.job["id"]


def start_job(api: Api, model_dir: Path, *, probes: bool = False, **overrides: Any) -> JobSetup:
    _, user = new_user(api)
    job, learner = running_job(api, user, model_dir, probes=probes, **(JOB | overrides))
    body = ok(api.admin.post("/v1/providers", json={"name": "gpu-co"}), 201)
    provider = api.client(body["token"])
    return JobSetup(job, learner, provider, body["token"])


def register(api: Api, setup: JobSetup, name: str = "w", **fields: Any) -> tuple[str, str]:
    body = ok(setup.provider.post("/v1/workers", json={"name": name, **fields}), 201)
    return body["worker"]["id"], body["token"]


@dataclass
class RunningWorker:
    worker: Worker
    thread: threading.Thread
    worker_id: str
    store: VersionStore
    relay: RelayServer | None
    result: list[int]

    @property
    def stats(self) -> Stats:
        return self.worker.stats

    def drain(self, timeout: float = 60) -> int:
        self.worker.request_drain()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "worker did not drain in time"
        if self.relay is not None:
            self.relay.stop()
        self.store.close()  # the process ended: the next worker on the data dir takes its versions over
        return self.result[0]


def start_worker(api: Api, setup: JobSetup, data_dir: Path, *, name: str = "w", relay: bool = False,
                 upload_bytes_per_s: float | None = None, activate_now: bool = True, server_url: str | None = None,
                 backend_factory: Callable[[], Any] | None = None, gen_batch_prompts: int | None = None,
                 **fields: Any) -> RunningWorker:
    store = VersionStore(data_dir / "versions")
    server = RelayServer(store, "127.0.0.1", 0, upload_bytes_per_s=upload_bytes_per_s).start() if relay else None
    if server is not None:
        fields["relay_url"] = server.url
    worker_id, token = register(api, setup, name, **fields)
    if activate_now:
        activate(api, worker_id, setup.id)
    control = ControlPlane(server_url or api.url, token)
    stats = Stats()
    if server is not None:
        server.meter = stats.upload
    options = LoopOptions(worker_id=worker_id, data_dir=data_dir, max_prompts=4, heartbeat_interval_s=1.0,
                          relay_url=server.url if server else None, gen_batch_prompts=gen_batch_prompts)
    factory = backend_factory or (lambda: create_backend("transformers", device="cpu"))
    worker = Worker(options, control, factory, store, stats)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(worker.run()), daemon=True)
    thread.start()
    return RunningWorker(worker, thread, worker_id, store, server, result)


class HostileRelay:
    """A peer relay on loopback whose every GET is answered by `answer(handler)`."""

    def __init__(self, answer: Callable[[BaseHTTPRequestHandler], None]) -> None:
        self.requests = 0
        self.closed = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                outer.requests += 1
                with contextlib.suppress(OSError):  # the client gave up
                    answer(self)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closed.set()
        self._httpd.shutdown()
        self._httpd.server_close()


class LyingRelay(HostileRelay):
    """A peer that answers every chunk request with the right number of wrong bytes; with `drip_s`, a byte at a
    time, one every `drip_s` seconds, without end (a chunk of 1 GiB, it says)."""

    def __init__(self, sizes: Callable[[str, int, int], int | None], drip_s: float | None = None) -> None:
        super().__init__(lambda handler: _lie(handler, sizes, drip_s))


def _lie(handler: BaseHTTPRequestHandler, sizes: Callable[[str, int, int], int | None], drip_s: float | None) -> None:
    parts = [p for p in handler.path.strip("/").split("/") if p != "delta"]  # v1 jobs J versions V chunks I
    size = sizes(parts[2], int(parts[4]), int(parts[6])) if len(parts) == 7 else None
    if drip_s is not None and size:
        handler.send_response(200)
        handler.send_header("Content-Length", str(2**30))
        handler.end_headers()
        while True:
            handler.wfile.write(b"\x00")
            handler.wfile.flush()
            time.sleep(drip_s)
    body = b"\x00" * size if size else b"{}"
    handler.send_response(200 if size else 404)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def make_next_version(src: Path, dst: Path, *, noise: float = 0.05, seed: int = 1) -> Path:
    """A 'published next version': the same folder with every weight nudged (as a training step would)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    for file in sorted(dst.glob("*.safetensors")):
        tensors = load_file(str(file))
        nudged = {k: (v + noise * torch.randn(v.shape, generator=gen, dtype=v.dtype)).contiguous()
                  for k, v in tensors.items()}
        save_file(nudged, str(file), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def next_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_next_version(tiny_model_dir, tmp_path_factory.mktemp("tiny-v1") / "model")


@pytest.fixture
def worker_factory(api: Api, tmp_path: Path) -> Iterator[Callable[..., RunningWorker]]:
    started: list[RunningWorker] = []

    def make(setup: JobSetup, name: str = "w", **kwargs: Any) -> RunningWorker:
        rw = start_worker(api, setup, tmp_path / name, name=name, **kwargs)
        started.append(rw)
        return rw

    yield make
    for rw in started:
        if rw.thread.is_alive():
            rw.drain()

