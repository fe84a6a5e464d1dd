"""`echo2-worker`: contribute a GPU (or a CPU, for tiny models) to Echo2 RL jobs.

    echo2-worker join --server https://echo2.example --token e2p_...   register and work until SIGTERM
                      (or ECHO2_PROVIDER_TOKEN=e2p_... in the environment instead of --token)
    echo2-worker bench [--model DIR] [--server URL --token ...]         measure generation and bandwidth
    echo2-worker status [--server URL]                                  this machine's registration

Arguments are parsed before anything heavy is imported: `--help` never loads torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from echo2 import logs

DEFAULT_RELAY_PORT = 7460
TOKEN_ENV = "ECHO2_PROVIDER_TOKEN"
ALIVE_WAIT_S = 3.0  # a heartbeat interval (2 s) and a half: long enough to see a live process beat
MAX_PRICE = 10_000  # USD per hour: the bound of echo2.protocol.common.Price (not imported: --help stays fast)
log = logging.getLogger("echo2_worker")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="echo2-worker", description="Echo2 rollout worker.")
    parser.add_argument("--config-dir", type=Path, default=None,
                        help="where credentials and benchmark results live (default: the user config dir)")
    sub = parser.add_subparsers(dest="command", required=True)

    join = sub.add_parser("join", help="register this machine and generate rollouts until stopped (SIGTERM drains)")
    join.add_argument("--server", required=True, help="control-plane URL, e.g. https://echo2.example")
    join.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                      help=f"provider token (e2p_...), or set {TOKEN_ENV} to keep it out of the process list; "
                           "saved for this server, so later joins may omit it")
    join.add_argument("--name", default=None, help="worker name (default: host name)")
    join.add_argument("--price-per-hour", type=_price, default=0.0, metavar="USD",
                      help="asking price in USD per hour (default 0: the worker earns nothing)")
    join.add_argument("--gpus", default="auto",
                      help="auto (nvidia-smi), none, N, or MODEL:COUNT[:VRAM_GB] such as H100:8:80 (VRAM_GB may be "
                           "left out only where nvidia-smi reports it); a CPU worker offers the machine's RAM, or "
                           "cpu:0:GB")
    join.add_argument("--region", default="local")
    join.add_argument("--max-upload-mbps", type=float, default=None, help="cap on relay upload, Mbit/s")
    relay = join.add_mutually_exclusive_group()
    relay.add_argument("--relay-port", type=int, default=DEFAULT_RELAY_PORT,
                       help=f"port of the chunk relay peers fetch from (default {DEFAULT_RELAY_PORT}; 0 = any free)")
    relay.add_argument("--no-relay", action="store_true", help="leaf only: do not serve chunks (e.g. behind NAT)")
    join.add_argument("--relay-host", default=None,
                      help="address peers reach this machine at (default: the local address routing to --server)")
    join.add_argument("--relay-bind", default=None, help="address the relay listens on (default: --relay-host)")
    join.add_argument("--backend", choices=["auto", "vllm", "transformers"], default="auto")
    join.add_argument("--device", default="auto", help="transformers backend device: auto, cpu, cuda, cuda:1")
    join.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                      help="what the model computes in (auto: bfloat16 on a GPU that has it, else float32); the "
                           "learner's audit allows for the precision's numerical differences")
    join.add_argument("--gpu-memory", type=_share, default=None, metavar="SHARE",
                      help="share of the GPU's memory to use, 0.1-0.95 (vLLM: gpu_memory_utilization, default 0.85; "
                           "transformers: of the free memory its KV cache may take, default 0.75)")
    join.add_argument("--max-batch", type=_rows, default=None, metavar="ROWS",
                      help="samples decoded at once (vLLM: max_num_seqs; transformers: rows, default sized from "
                           "free GPU memory, 64 on a CPU)")
    join.add_argument("--compile-decode", action="store_true",
                      help="transformers on a GPU: compile the decode step with CUDA graphs; about 3x the tokens/s of "
                           "a 135M model on an H100, after about a minute of compiling for each new batch shape "
                           "(docs/BENCHMARKS.md)")
    join.add_argument("--max-prompts", type=_prompts, default=8, help="prompts per lease (1 to 256)")
    join.add_argument("--data-dir", type=Path, default=None,
                      help="where weight versions are kept (default: the user cache dir); each worker running on "
                           "the machine keeps its own folder in it (versions, versions-2, ...)")
    join.add_argument("--no-bench", action="store_true", help="register without measuring throughput first")
    join.add_argument("--new", action="store_true",
                      help="register a new worker even if one is saved for --server (it stays saved: a later join "
                           "registered as it, e.g. with its --relay-port, starts it again)")
    join.add_argument("--json", action="store_true", default=logs.env_format() == "json",
                      help=f"structured JSON logs instead of a progress line (or {logs.FORMAT_ENV}=json)")
    join.add_argument("-v", "--verbose", action="store_true")

    bench = sub.add_parser("bench", help="measure generation throughput and bandwidth to the server")
    bench.add_argument("--model", type=Path, default=None, help="HF folder (default: a tiny random Qwen2)")
    bench.add_argument("--backend", choices=["auto", "vllm", "transformers"], default="auto")
    bench.add_argument("--device", default="auto")
    bench.add_argument("--prompts", type=int, default=8)
    bench.add_argument("--group-size", type=int, default=4)
    bench.add_argument("--max-new-tokens", type=int, default=32)
    bench.add_argument("--seconds", type=float, default=5.0)
    bench.add_argument("--server", default=None, help="also measure bandwidth to this control plane")
    bench.add_argument("--token", default=None, help="provider token (for the upload probe)")
    bench.add_argument("--json", action="store_true")

    status = sub.add_parser("status", help="the saved registration and what the server says about this worker")
    status.add_argument("--server", default=None, help="only this server (default: every saved one)")
    status.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "join":
            return _join(args)
        if args.command == "bench":
            return _bench(args)
        return _status(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line a person can act on, never a traceback (STYLE #9)
        from .progress import scrub

        msg = scrub(str(exc)) or type(exc).__name__
        sys.stderr.write(f"echo2-worker: error: {msg}\n")
        if getattr(args, "verbose", False):
            raise
        return 1


# -- join ------------------------------------------------------------------------------------------


def _join(args: argparse.Namespace) -> int:
    import platform
    import signal

    from .config import CredentialStore, SavedWorker, default_data_dir, normalize_server, now_iso
    from .control import ControlPlane
    from .hardware import choose_backend, parse_gpus, reachable_host, with_memory
    from .loop import LoopOptions, Worker
    from .progress import ProgressReporter, Stats, setup_logging
    from .relay import RelayServer
    from .store import VersionStore

    setup_logging(args.json, logging.DEBUG if args.verbose else logging.INFO)
    server = normalize_server(args.server)
    creds = CredentialStore(args.config_dir)
    saved = creds.load(server) or SavedWorker(server=server)
    provider_token = args.token or saved.provider_token
    if provider_token is None and not saved.worker_token:
        raise ValueError(f"--token PROVIDER_TOKEN (or {TOKEN_ENV}) is required the first time you join this server")
    if args.token:
        saved.provider_token = args.token
    gpus = with_memory(parse_gpus(args.gpus))
    backend_name = choose_backend(args.backend, gpus)
    if not args.price_per_hour:  # said before the benchmark, so a forgotten flag costs one restart
        log.warning("asking $0.00/h: this worker will earn nothing for its work; to be paid, join with "
                    "--price-per-hour USD, e.g. --price-per-hour 0.40")
    stats = Stats()
    store = VersionStore((args.data_dir or default_data_dir()) / "versions")

    relay = None
    if not args.no_relay:
        host = args.relay_host or reachable_host(server)
        cap = args.max_upload_mbps * 1e6 / 8 if args.max_upload_mbps else None
        relay = _start_relay(RelayServer, store, args.relay_bind or host, args.relay_port, host, cap, stats)
        log.info("relay serving chunks at %s%s", relay.url,
                 f" (upload capped at {args.max_upload_mbps:g} Mbit/s)" if cap else "")

    control = ControlPlane(server)
    try:
        check_version(control, server, backend_name)
        if args.token or args.new or not _saved_worker_usable(control, saved):  # it will register with its token
            if provider_token is None:
                raise ValueError(f"the worker saved in {creds.path} is no longer valid on {server}: pass --token "
                                 f"PROVIDER_TOKEN (or {TOKEN_ENV}) to register again")
            source = f"given by --token or {TOKEN_ENV}" if args.token else f"saved in {creds.path}"
            check_provider_token(control, provider_token, source)
        body = _registration(args, server, provider_token, gpus, backend_name, relay.url if relay else None,
                             platform.node())
        worker_id, worker_token, reg = _register_or_reuse(control, creds, saved, body, provider_token, args.new)
        saved.worker_id, saved.worker_token, saved.name = worker_id, worker_token, body.name
        saved.registered_at = saved.registered_at or now_iso()
        saved.registration = body.model_dump(mode="json")
        creds.save(saved)
        control.token = worker_token
        log.info("worker %s (%s) joined %s with backend %s, asking %s%s", worker_id, body.name, server,
                 backend_name, _per_hour(body.price_per_hour), "" if relay else " (leaf only, no relay)")

        opts = LoopOptions(worker_id=worker_id, data_dir=store.root, max_prompts=args.max_prompts,
                           heartbeat_interval_s=reg, relay_url=relay.url if relay else None)
        worker = Worker(opts, control, _backend_factory(backend_name, args), store, stats,
                        on_deregistered=lambda: creds.forget_worker(server, worker_id))
        _install_signals(signal, worker)
        reporter = ProgressReporter(stats).start()
        try:
            code = _run_in_thread(worker)
        finally:
            reporter.stop()
        log.info("stopped (%d rollouts accepted, %d rejected)", stats.rollouts_accepted, stats.rollouts_rejected)
        return code
    finally:
        control.close()
        if relay is not None:
            relay.stop()
        store.close()


def check_version(control: Any, server: str, backend: str) -> None:
    """Refuse to join a control plane of another version, saying what to install: the protocol is released with
    the platform, and the control plane serves the worker of its own version (its package index)."""
    from importlib.metadata import PackageNotFoundError, version

    import echo2

    platform = _platform_version(control, server)
    if platform is None:
        return
    try:
        mine = {"echo2-worker": version("echo2-worker"), "echo2": echo2.__version__}
    except PackageNotFoundError:  # run from a source tree without installing: the tree is what it is
        return
    wrong = {name: have for name, have in mine.items() if platform.packages.get(name, platform.version) != have}
    if wrong:
        extra = "vllm" if backend == "vllm" else "cpu"
        have = ", ".join(f"{name} {v}" for name, v in wrong.items())
        raise ValueError(f"this machine has {have}, but {server} runs Echo2 {platform.version}: install its "
                         f"version with  pip install --upgrade --index-url {platform.index_url} "
                         f"'echo2-worker[{extra}]=={platform.version}' 'echo2=={platform.version}'")
    log.info("the control plane runs Echo2 %s, as this worker does", platform.version)


def _platform_version(control: Any, server: str) -> Any:
    """What the control plane says it runs; None from one that predates /v1/version. Another service at the
    URL (a web server's 404 page, a proxy) is refused here rather than failing later on its HTML."""
    from echo2 import errors

    try:
        return control.platform_version()
    except (errors.APIStatusError, errors.UnexpectedResponseError) as exc:
        answer = exc.response
        kind = answer.headers.get("content-type", "").split(";")[0] if answer is not None else ""
        # Every error Echo2 answers is problem+json (api/errors.py), since its first version.
        if isinstance(exc, errors.UnexpectedResponseError) or not kind.startswith("application/problem+json"):
            what = f"{answer.status_code} {kind}".strip() if answer is not None else str(exc)
            raise ValueError(f"{server} is not an Echo2 control plane (GET {server}/v1/version answered {what}): "
                             "give --server the control plane's base URL, e.g. http://CONTROL_PLANE:8000") from None
        if not isinstance(exc, errors.NotFoundError):
            raise
    log.warning("%s does not say its version (it predates /v1/version); joining anyway", server)
    return None


def _saved_worker_usable(control: Any, saved: Any) -> bool:
    """Whether the saved worker's token still names a registered worker: asked before the benchmark, so a stale
    one is said at once (whether its registration still matches is known once the benchmark made the new one)."""
    from echo2 import errors

    if not (saved.worker_id and saved.worker_token):
        return False
    try:
        return control.get_worker(saved.worker_id, token=saved.worker_token).status.value != "deregistered"
    except (errors.AuthenticationError, errors.NotFoundError):
        return False


def check_provider_token(control: Any, token: str, source: str) -> None:
    """Ask the control plane whose token this is before the model loads and the benchmark runs (seconds to
    minutes), so that a wrong token is said at once."""
    from echo2 import errors

    try:
        provider = control.provider(token)
    except errors.AuthenticationError as exc:
        raise ValueError(f"{control.server_url} does not know the provider token {source} ({exc.detail}): pass "
                         f"a valid one with --token e2p_... or {TOKEN_ENV}=e2p_...") from None
    except errors.PermissionDeniedError as exc:
        raise ValueError(f"the token {source} is not a provider token ({exc.detail}): join needs the e2p_... "
                         "token the control plane's admin gets by signing the provider up (POST /v1/providers); "
                         f"pass it with --token or {TOKEN_ENV}") from None
    if provider.banned_at is not None:
        why = f": {provider.standing_reason}" if provider.standing_reason else ""
        raise ValueError(f"provider {provider.name} is banned and registers no more workers{why}")
    log.info("provider token of %s accepted", provider.name)


def _start_relay(cls: Any, store: Any, bind: str, port: int, host: str, cap: float | None, stats: Any) -> Any:
    try:
        relay = cls(store, bind, port, upload_bytes_per_s=cap, meter=stats.upload, advertise_host=host)
    except OSError as exc:
        if port == 0:
            raise
        log.warning("relay port %d unavailable (%s); using a free one", port, exc.strerror or exc)
        relay = cls(store, bind, 0, upload_bytes_per_s=cap, meter=stats.upload, advertise_host=host)
    return relay.start()


def _registration(args: argparse.Namespace, server: str, provider_token: str | None, gpus: Any, backend: str,
                  relay_url: str | None, hostname: str) -> Any:
    from echo2.protocol import WorkerRegister

    from .config import load_bench

    measured: dict[str, Any] = {}
    saved = load_bench(args.config_dir)
    if saved and saved.get("backend") == backend and saved.get("tokens_per_s"):
        measured = saved
    elif not args.no_bench:
        log.info("measuring generation throughput (%s backend, a few seconds; --no-bench skips this)", backend)
        from .benchmark import bench_generation

        measured = bench_generation(backend, seconds=2.0, device=args.device)
    try:
        from .benchmark import bench_bandwidth

        measured = measured | bench_bandwidth(server, provider_token, seconds=1.0)
    except Exception as exc:  # the probe is best effort: registration reports defaults then
        log.warning("bandwidth probe failed: %s", exc)
    return WorkerRegister(
        name=(args.name or hostname or "worker")[:128], gpu_model=gpus.model, gpu_count=gpus.count,
        vram_gb=gpus.vram_gb, price_per_hour=args.price_per_hour, region=args.region,
        upload_mbps=min(1e6, measured.get("upload_mbps", 100.0)),
        download_mbps=min(1e6, measured.get("download_mbps", 100.0)),
        max_upload_mbps=args.max_upload_mbps, relay_url=relay_url, backends=[backend],
        rollouts_per_s=measured.get("groups_per_s", 0.0), tokens_per_s=measured.get("tokens_per_s", 0.0),
    )


_IDENTITY = ("name", "gpu_model", "gpu_count", "vram_gb", "price_per_hour", "region", "max_upload_mbps",
             "relay_url", "backends")


def _register_or_reuse(control: Any, creds: Any, saved: Any, body: Any, provider_token: str | None,
                       force_new: bool) -> tuple[str, str, float]:
    """Reuse the saved worker when it is still valid and registered with the same identity, else replace it (unless
    another process runs it), else register; `saved` becomes the worker saved for the server with this identity."""
    from echo2 import errors

    new = body.model_dump(mode="json")
    if not force_new:
        _take_saved_twin(creds, saved, new)
    if saved.worker_id and saved.worker_token and not force_new:
        same = _same_identity(saved.registration, new)
        control.token = saved.worker_token
        try:
            worker = control.get_worker(saved.worker_id)
            if same and worker.status.value != "deregistered":
                log.info("reusing saved registration %s", saved.worker_id)
                return saved.worker_id, saved.worker_token, 2.0
            if worker.status.value not in ("offline", "deregistered") and _beating(control, worker):
                raise ValueError(_alive(saved.worker_id, worker.status.value, worker.last_heartbeat_at))
            control.deregister(saved.worker_id)  # registered differently (price, relay address...): replace it
            log.info("registration changed; replaced worker %s", saved.worker_id)
        except (errors.AuthenticationError, errors.NotFoundError):
            pass  # deregistered or unknown to this server: register afresh
        creds.forget_worker(saved.server, saved.worker_id)  # replaced or gone: not kept beside the new one
        control.token = None
    if provider_token is None:
        raise ValueError("the saved worker is no longer valid: pass --token PROVIDER_TOKEN to register again")
    reg = control.register(provider_token, body)
    saved.registered_at = None  # a new worker: join dates it
    return reg.worker.id, reg.token, reg.heartbeat_interval_s


def _take_saved_twin(creds: Any, saved: Any, new: dict[str, Any]) -> None:
    """A join registered as a worker saved for the server (its name, price, --relay-port...) is that worker started
    again: `saved` becomes it, though another join on this config dir (with --new) saved its own since."""
    for other in creds.saved(saved.server):
        if other.worker_id and other.worker_token and _same_identity(other.registration, new):
            saved.worker_id, saved.worker_token = other.worker_id, other.worker_token
            saved.registered_at, saved.registration = other.registered_at, other.registration
            return


def _same_identity(registration: dict[str, Any], new: dict[str, Any]) -> bool:
    return all(registration.get(k) == new.get(k) for k in _IDENTITY)


def _beating(control: Any, worker: Any) -> bool:
    """Whether another process heartbeats as the saved worker now: its last heartbeat moves within a beat and a
    half. A process that crashed (restarted at once, its relay on a new port) does not, and is replaced."""
    time.sleep(ALIVE_WAIT_S)
    return control.get_worker(worker.id).last_heartbeat_at != worker.last_heartbeat_at


def _alive(worker_id: str, status: str, beat: Any) -> str:
    """Why a join does not replace the saved worker: a second `join` on one config dir (its relay port taken by
    the first, so registered differently) deregistered the worker the first was running."""
    return (f"worker {worker_id}, saved in this config dir, is {status} and heartbeating (last {beat}): another "
            "`echo2-worker join` is running it, and registering anew would deregister it. Stop that one first, or "
            "give this one a --config-dir of its own, or pass --new with a --relay-port (or --name) of its own to "
            "register a second worker beside it (both stay saved: each starts again as itself, this one with the "
            "same flags and without --new)")


def _price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of US dollars per hour, e.g. 0.40") from None
    if not 0 <= value <= MAX_PRICE:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"{text} is not a price between 0 and {MAX_PRICE} US dollars per hour")
    return value


def _per_hour(price: float) -> str:
    return f"${price:.2f}/h" if round(price, 2) == price else f"${price:g}/h"


def _share(text: str) -> float:
    value = float(text)
    if not 0.1 <= value <= 0.95:
        raise argparse.ArgumentTypeError(f"{text} is not a share of memory between 0.1 and 0.95")
    return value


def _prompts(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 256:  # echo2.protocol.LeaseRequest.max_prompts
        raise argparse.ArgumentTypeError(f"{text} is not a number of prompts per lease between 1 and 256")
    return value


def _rows(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65_536:
        raise argparse.ArgumentTypeError(f"{text} is not a number of rows between 1 and 65536")
    return value


def _backend_factory(name: str, args: argparse.Namespace) -> Any:
    options: dict[str, Any] = {"dtype": args.dtype}
    if name == "transformers":
        options |= {"device": args.device, "max_batch_rows": args.max_batch, "compile_decode": args.compile_decode}
        if args.gpu_memory is not None:
            options["memory_share"] = args.gpu_memory
    else:
        options |= {k: v for k, v in (("gpu_memory_utilization", args.gpu_memory),
                                      ("max_num_seqs", args.max_batch)) if v is not None}

    def make() -> Any:
        from .backends import create_backend

        try:  # the loading bar would break --json lines and the progress line
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:
            pass

        return create_backend(name, **options)

    return make


def _run_in_thread(worker: Any) -> int:
    """The loop runs in its own thread; the main thread only waits and takes signals, so a signal is
    handled at once even in the middle of a generation (and torch's CPU thread pool is not tied to
    the main thread, which on an oversubscribed CPU made generation several times slower)."""
    import threading

    result: list[int] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            result.append(worker.run())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, name="echo2-loop", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:  # a second signal: give the loop a moment to release and deregister
        worker.request_drain()
        thread.join(15)
        return 130
    if failure:
        raise failure[0]
    return result[0]


def _install_signals(signal: Any, worker: Any) -> None:
    def handler(signum: int, frame: object) -> None:
        if worker.draining:
            raise KeyboardInterrupt  # second signal: stop now (the lease is still released)
        log.info("signal %d: draining (finishing the batch in flight, then leaving)", signum)
        worker.request_drain()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


# -- bench -----------------------------------------------------------------------------------------


def _bench(args: argparse.Namespace) -> int:
    from .benchmark import bench_bandwidth, bench_generation
    from .config import save_bench
    from .hardware import choose_backend, detect_gpus

    logs.configure(logs.env_format(), logging.WARNING)
    backend = choose_backend(args.backend, detect_gpus())
    result = bench_generation(backend, args.model, prompts=args.prompts, group_size=args.group_size,
                              max_new_tokens=args.max_new_tokens, seconds=args.seconds, device=args.device)
    if args.server:
        result |= bench_bandwidth(args.server, args.token)
    if args.model is None:
        save_bench(result, args.config_dir)  # join reports these at registration
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>16}: {value}")
    return 0


# -- status ----------------------------------------------------------------------------------------


def _status(args: argparse.Namespace) -> int:
    from echo2 import errors

    from .config import CredentialStore, normalize_server
    from .control import ControlPlane

    creds = CredentialStore(args.config_dir)
    entries = [e for e in creds.all() if args.server is None or e.server == normalize_server(args.server)]
    if not entries:
        print("no saved registration; run `echo2-worker join --server URL --token PROVIDER_TOKEN`", file=sys.stderr)
        return 1
    out = []
    for saved in entries:
        item: dict[str, Any] = saved.public()
        if saved.worker_id and saved.worker_token:
            control = ControlPlane(saved.server, saved.worker_token, max_retries=1, timeout=10)
            try:
                item["server_says"] = control.get_worker(saved.worker_id).model_dump(mode="json")
                item["placement"] = [p.model_dump(mode="json") for p in control.placement(saved.worker_id)]
            except errors.Echo2Error as exc:  # the worker's own figures stay, where only its placement failed
                item.setdefault("server_says", {"error": str(exc)})
            finally:
                control.close()
        out.append(item)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for item in out:
        print(f"server {item['server']}: worker {item['worker_id'] or '(none)'} {item['name'] or ''}")
        says = item.get("server_says") or {}
        if "error" in says:
            print(f"  server: {says['error']}")
        elif says:
            print(f"  status {says['status']} (desired {says['desired']}), job {says['job_id'] or '-'}, "
                  f"version held {says['version_held']}, rollouts {says['accepted_rollouts']} accepted / "
                  f"{says['rejected_rollouts']} rejected, last heartbeat {says['last_heartbeat_at']}")
            print(f"  trust {_trust_line(says)}")
        for p in item.get("placement") or []:  # why it is idle, or where it works: the scheduler's newest lines
            print(f"  scheduler, job {p['job_id'] or '-'}: {p['line']} ({p['decided_at']})")
    return 0


def _trust_line(says: dict[str, Any]) -> str:
    """E.g. "quarantined until 2026-12-07T11:02:00Z: quarantined: 2 strikes, latest: failed its audit ..."."""
    line = str(says.get("trust"))
    if says.get("quarantined_until") and says.get("trust") == "quarantined":
        line += f" until {says['quarantined_until']}"
    return f"{line}: {says['trust_reason']}" if says.get("trust_reason") else line


if __name__ == "__main__":
    sys.exit(main())
