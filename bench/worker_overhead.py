"""Worker overhead: groups/s of the full worker loop vs calling the backend directly, same prompts.

    python bench/worker_overhead.py                 # 64 prompts, G = 8, 128 new tokens, tiny model, CPU
    python bench/worker_overhead.py --rounds 1 --prompts 32

Setup: the real control plane as a subprocess (`python -m server.cli api`, SQLite), the tiny model
(learner.tiny) published as version 0 of a running job, one worker registered and activated.

- direct: `TransformersBackend.generate` on the job's prompts, in batches of `--max-prompts`, with
  exactly the requests the worker builds (encode_prompt ids, sample_seed seeds, the job's sampling).
- worker: `echo2_worker.loop.Worker` in this process - heartbeat thread, lease, generate, submit,
  renew - timed from the moment its backend holds version 0 until every prompt's group is accepted.
  The server shares the machine's CPUs, so its request handling counts against the worker here.

Direct and worker runs alternate (`--rounds`, a fresh job each) and medians are compared; the process
is warmed up first (torch's first few generate calls in a process take seconds). Both run generation
off the main thread, as `echo2-worker join` does, with torch pinned to one thread by default: on a
shared, oversubscribed 2-core box torch's 2-thread pool made the same direct run vary 0.3 s - 21 s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from learner_staleness import ADMIN_KEY, control_plane, ok  # noqa: E402 - the same control plane helper


def setup_job(url: str, work: Path, model: Path, args: argparse.Namespace) -> tuple[str, str, str, list[dict]]:
    """A running job with version 0 published; a registered worker activated on it (as the scheduler does)."""
    import httpx
    from echo2.snapshots import build_manifest

    from api.db import Database
    from api.models import Job, Worker
    from api.services.fleet import assign
    from api.settings import get_settings
    from learner.remote import ControlPlane

    def client(token: str) -> httpx.Client:
        return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120)

    admin = client(ADMIN_KEY)
    user = client(ok(admin.post("/v1/users", json={"name": "bench", "role": "user"}), 201)["api_key"])
    spec = {"name": "overhead", "base_model": "echo2:tiny", "task": {"name": "arithmetic"},
            "grpo": {"group_size": args.group_size, "prompts_per_step": 64, "max_new_tokens": args.max_new_tokens},
            "num_prompts": args.prompts, "staleness": 2, "max_steps": 1000}
    job = ok(user.post("/v1/jobs", json=spec), 201)
    learner = ControlPlane(url, ok(admin.post(f"/v1/jobs/{job['id']}/learner/token"), 201)["token"], job["id"])
    learner.start()
    learner.publish([(model, build_manifest(model, 0, 0, 256 * 1024))])
    learner.close()
    provider = client(ok(admin.post("/v1/providers", json={"name": "bench"}), 201)["token"])
    reg = ok(provider.post("/v1/workers", json={"name": "w0"}), 201)
    db = Database(f"sqlite:///{work / 'echo2.db'}")
    with db.session() as s:
        assign(s, s.get(Worker, reg["worker"]["id"]), s.get(Job, job["id"]), get_settings())
        s.commit()
    prompts = ok(user.get(f"/v1/jobs/{job['id']}/prompts", params={"limit": args.prompts}))["items"]
    return job["id"], reg["worker"]["id"], reg["token"], prompts


def run_direct(model: Path, job_id: str, prompts: list[dict], args: argparse.Namespace,
               warmup: bool = False) -> tuple[float, int]:
    from echo2.prompting import encode_prompt
    from echo2.seeds import prompt_seed, sample_seed
    from echo2_worker.backends import GenRequest, create_backend

    backend = create_backend("transformers", device="cpu")
    backend.load(model)
    g = args.group_size
    requests = []
    for p in prompts:
        base = prompt_seed(0, job_id, p["index"], p["epoch"])
        requests.append(GenRequest(prompt_token_ids=encode_prompt(backend.tokenizer, p["text"]), n=g,
                                   seeds=[sample_seed(base, k) for k in range(g)],
                                   max_new_tokens=args.max_new_tokens))
    timing: list[float] = []

    def generate_all() -> None:  # in a thread, like the worker's loop (see the module docstring)
        for _ in range(3 if warmup else 0):  # torch's first calls in a process are seconds slower
            backend.generate(requests[: args.max_prompts])
        t0, tokens = time.perf_counter(), 0
        for i in range(0, len(requests), args.max_prompts):
            out = backend.generate(requests[i : i + args.max_prompts])
            tokens += sum(len(s.token_ids) for group in out for s in group)
        timing.extend([time.perf_counter() - t0, tokens])

    thread = threading.Thread(target=generate_all)
    thread.start()
    thread.join()
    backend.close()
    return timing[0], int(timing[1])


def run_worker(url: str, worker_id: str, token: str, work: Path, n: int, args: argparse.Namespace) -> tuple[float, int]:
    from echo2_worker.backends import create_backend
    from echo2_worker.control import ControlPlane
    from echo2_worker.loop import LoopOptions, Worker
    from echo2_worker.store import VersionStore

    store = VersionStore(work / "worker" / "versions")
    options = LoopOptions(worker_id=worker_id, data_dir=work / "worker", max_prompts=args.max_prompts,
                          heartbeat_interval_s=1.0)
    worker = Worker(options, ControlPlane(url, token), lambda: create_backend("transformers", device="cpu"), store)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    while worker.stats.version_loaded is None:
        time.sleep(0.005)
    t0 = time.perf_counter()
    while worker.stats.rollouts_accepted < n:
        if not thread.is_alive():
            raise RuntimeError("the worker stopped early")
        time.sleep(0.005)
    seconds = time.perf_counter() - t0
    tokens = worker.stats.tokens.total
    worker.request_drain()
    thread.join(60)
    return seconds, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompts", type=int, default=8, help="prompts per lease = per backend call")
    ap.add_argument("--rounds", type=int, default=3, help="direct/worker pairs; medians are reported")
    ap.add_argument("--torch-threads", type=int, default=1, help="0 = torch's default")
    args = ap.parse_args()
    import logging
    import statistics

    import torch

    logging.basicConfig(level=logging.WARNING)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    from learner.tiny import build_tiny_model

    direct_runs: list[tuple[float, int]] = []
    worker_runs: list[tuple[float, int]] = []
    with tempfile.TemporaryDirectory(prefix="echo2-overhead-") as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "model", seed=0)
        with control_plane(work) as url:
            for r in range(args.rounds):  # a fresh job per round: a worker run consumes its prompts
                job_id, worker_id, token, prompts = setup_job(url, work, model, args)
                direct_runs.append(run_direct(model, job_id, prompts, args, warmup=r == 0))
                worker_runs.append(run_worker(url, worker_id, token, work / f"r{r}", len(prompts), args))
    n = args.prompts
    d = statistics.median(s for s, _ in direct_runs)
    w = statistics.median(s for s, _ in worker_runs)
    same = {t for _, t in direct_runs} == {t for _, t in worker_runs}
    print(f"worker overhead {date.today()}: tiny model, {n} prompts x G={args.group_size}, {args.max_new_tokens} "
          f"new tokens, {args.max_prompts} prompts per lease, torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'':>8} {'median s':>9} {'groups/s':>9} {'tokens/s':>9}   runs (s)")
    for name, runs, med in (("direct", direct_runs, d), ("worker", worker_runs, w)):
        tokens = runs[0][1]
        print(f"{name:>8} {med:>9.2f} {n / med:>9.2f} {tokens / med:>9.0f}   "
              + ", ".join(f"{s:.2f}" for s, _ in runs))
    print(f"same tokens generated by both (same prompts and seeds): {same}")
    print(f"ratio worker/direct (groups/s, medians): {d / w:.3f}")


if __name__ == "__main__":
    main()
