"""Weight dissemination: pipelined peer relay vs star, against the ideal M/B.

    python bench/relay.py                       # N in 4 8 16, B = 4 MB/s, M = 16 MiB, 128 KiB chunks
    python bench/relay.py --n 16 --topologies chain --bandwidth-mb 8 --size-mb 32 --chunk-kb 256

One origin capped at B bytes/s, N worker relay processes each capped at B upload, a snapshot of M
bytes. The origin here is an `echo2_worker.relay.RelayServer` over the published version, in its own
process - it serves the same paths as the control plane's chunk route
(`/v1/jobs/{job}/versions/{v}/chunks/{i}`) - not the real API (which has no upload cap). Each worker
process is the worker's own relay: `echo2_worker.fetch.Downloader` (sha256-checked chunks, fallback
to the origin) feeding an `echo2_worker.relay.RelayServer` that serves every chunk it holds while later
ones arrive. Completion = the slowest worker holds the assembled, verified folder.

On a 2-core machine every relay hop costs CPU (HTTP, sha256, disk), and 17 processes moving B each
saturate it at B = 8 MB/s; the default B keeps the run bandwidth-bound and the whole table under ~4 min.

Topologies, with parents given exactly as the control plane gives them (`api.services.fleet.RelayTree`:
peers in upload order, worker i under peer (i-1)//k, the origin last):
  star    every worker fetches from the origin: ~N*M/B.
  chain   relay tree of fan-out k=1 (the server's default relay_fanout): a pipeline, ~(M + N*chunk)/B.
  tree-2  fan-out k=2: each relay feeds two children at B/2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

JOB = "job_relaybench"
KEY = "b" * 64  # the version's relay key; the origin stand-in takes it as the worker token too


# ---------------------------------------------------------------- one process: origin or worker relay


def node_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--manifest", type=Path, required=True)
    p.add_argument("--cap", type=float, required=True)
    p.add_argument("--parents", default="")
    args = p.parse_args(argv)

    from echo2.protocol import Manifest
    from echo2_worker.fetch import Downloader
    from echo2_worker.relay import RelayServer
    from echo2_worker.store import VersionStore

    manifest = Manifest.model_validate_json(args.manifest.read_bytes())
    store = VersionStore(args.store)
    store.open(JOB, manifest, KEY)  # known before "go", as a worker knows the version from its heartbeat
    relay = RelayServer(store, upload_bytes_per_s=args.cap).start()
    dl = Downloader(store, origin_token=KEY)  # made before "go", as a running worker has it already
    sys.stdout.write(json.dumps({"url": relay.url}) + "\n")
    sys.stdout.flush()
    if sys.stdin.readline().strip() != "go":
        return
    if args.parents:
        result = dl.fetch(JOB, manifest, args.parents.split(","), relay_key=KEY)
        sys.stdout.write(json.dumps({"done": time.time(), "bytes_from": result.bytes_from}) + "\n")
        sys.stdout.flush()
    sys.stdin.readline()  # keep serving children until the driver closes stdin
    relay.stop()


# ---------------------------------------------------------------- the driver


def make_snapshot(root: Path, size: int, chunk: int) -> Path:
    """A published version of `size` random bytes (one safetensors-named file; its content is opaque here)."""
    from echo2.snapshots import build_manifest, iter_stream
    from echo2_worker.store import VersionStore

    folder = root / "model"
    folder.mkdir(parents=True)
    with open(folder / "model.safetensors", "wb") as fh:
        for offset in range(0, size, 2**20):
            fh.write(os.urandom(min(2**20, size - offset)))
    (folder / "config.json").write_text("{}")
    manifest = build_manifest(folder, 0, 0, chunk)
    held = VersionStore(root / "origin").open(JOB, manifest, KEY)
    for i, data in enumerate(iter_stream(folder, manifest.files, chunk)):
        held.put(i, data)
    held.assemble()
    path = root / "manifest.json"
    path.write_text(manifest.model_dump_json())
    return path


def spawn(store: Path, manifest: Path, cap: float, parents: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, __file__, "node", "--store", str(store), "--manifest", str(manifest),
                             "--cap", str(cap), "--parents", ",".join(parents)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, json.loads(proc.stdout.readline())["url"]


def parents_of(i: int, urls: list[str], origin: str, fanout: int | None) -> list[str]:
    if fanout is None:
        return [origin]
    return ([urls[(i - 1) // fanout]] if i > 0 else []) + [origin]


def run_once(root: Path, manifest: Path, n: int, cap: float, fanout: int | None) -> tuple[float, float]:
    """Seconds until every worker holds the version, and the share of bytes served by the origin."""
    work = Path(tempfile.mkdtemp(dir=root))
    origin, origin_url = spawn(root / "origin", manifest, cap, [])
    procs: list[subprocess.Popen] = []
    urls: list[str] = []
    try:
        for i in range(n):  # parents must exist before their children: spawn in tree order
            proc, url = spawn(work / f"w{i}", manifest, cap, parents_of(i, urls, origin_url, fanout))
            procs.append(proc)
            urls.append(url)
        t0 = time.time()
        for proc in [origin, *procs]:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        reports = [json.loads(proc.stdout.readline()) for proc in procs]
        seconds = max(r["done"] for r in reports) - t0
        total = sum(sum(r["bytes_from"].values()) for r in reports)
        from_origin = sum(r["bytes_from"].get(origin_url, 0) for r in reports)
        return seconds, from_origin / total
    finally:
        for proc in [origin, *procs]:
            proc.stdin.close()
        for proc in [origin, *procs]:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        subprocess.run(["rm", "-rf", str(work)], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--bandwidth-mb", type=float, default=4.0, help="B, MB/s (10^6 bytes)")
    ap.add_argument("--size-mb", type=float, default=16, help="M, MiB")
    ap.add_argument("--chunk-kb", type=int, default=128, help="chunk size, KiB")
    ap.add_argument("--topologies", nargs="+", default=["chain", "tree-2", "star"],
                    choices=["chain", "tree-2", "star"])
    args = ap.parse_args()
    cap, size, chunk = args.bandwidth_mb * 1e6, int(args.size_mb * 2**20), args.chunk_kb * 1024
    ideal = size / cap
    fanouts = {"chain": 1, "tree-2": 2, "star": None}
    print(f"relay benchmark {date.today()}: B = {args.bandwidth_mb:g} MB/s (origin and every worker upload), "
          f"M = {args.size_mb:g} MiB, chunk = {args.chunk_kb} KiB, ideal M/B = {ideal:.2f} s, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at start")
    print(f"{'N':>3} {'topology':>8} {'seconds':>8} {'x ideal':>8} {'origin share':>13}")
    with tempfile.TemporaryDirectory(prefix="echo2-relay-bench-") as tmp:
        root = Path(tmp)
        manifest = make_snapshot(root, size, chunk)
        rows = []
        for n in args.n:
            for topo in args.topologies:
                seconds, share = run_once(root, manifest, n, cap, fanouts[topo])
                rows.append((n, topo, seconds))
                print(f"{n:>3} {topo:>8} {seconds:>8.2f} {seconds / ideal:>8.2f} {share:>12.0%}", flush=True)
    by = {(n, t): s for n, t, s in rows}
    if "chain" in args.topologies and "star" in args.topologies:
        for n in args.n:
            print(f"N={n}: star/chain = {by[(n, 'star')] / by[(n, 'chain')]:.1f}x")
    print(f"load average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "node":
        node_main(sys.argv[2:])
    else:
        main()
