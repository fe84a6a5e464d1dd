"""The control plane's FastAPI application."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from echo2 import logs
from fastapi import FastAPI
from starlette.types import ASGIApp

import web

from . import errors, openapi, tinker
from .db import Database
from .fastpath import HeartbeatPath
from .routes import (
    datasets,
    estimates,
    evals,
    export,
    fleet,
    health,
    jobs,
    learner,
    learner_state,
    leases,
    ledger,
    packages,
    traces,
    users,
    weights,
)
from .services import retention
from .services.heartbeats import Heartbeats
from .services.notices import Announcer
from .services.packages import VERSION, WheelIndex
from .settings import Settings, get_settings
from .storage import BlobStore
from .telemetry import MetricsMiddleware, Telemetry
from .tinker import futures as tinker_futures

# The routes weight, checkpoint and Tinker state chunks are PUT to: the only ones given max_chunk_bytes.
CHUNK_PUTS = re.compile(r"/v1/jobs/[^/]+/(versions/\d+(/delta)?|learner/checkpoints/\d+)/chunks/\d+"
                        r"|/v1/tinker/host/states/[0-9a-f]{64}/chunks/\d+")
DESCRIPTION = """Echo2 control plane: RL post-training jobs run by a central GRPO learner with rollouts
from distributed workers under a staleness bound S. Authenticate with `Authorization: Bearer <token>`:
a user API key, a provider token, a worker token or a job's learner token. Errors are
`application/problem+json` naming the field and the reason."""


class _App(FastAPI):
    """FastAPI with the worker heartbeat's own path (api/fastpath.py) outside all its layers: a fleet's beats are
    most of the requests, and each layer a request passes costs CPU on every await it resumes through (the
    layers were ~10 % of a beat's server CPU, docs/BENCHMARKS.md)."""

    heartbeat_path: Callable[[ASGIApp], ASGIApp] | None = None

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        return stack if self.heartbeat_path is None else self.heartbeat_path(stack)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    db = Database(settings.database_url)
    telemetry = Telemetry(db)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.bootstrap_api_key:
            from .bootstrap import ensure_admin

            ensure_admin(db, settings.bootstrap_api_key)
        # Everything loaded so far (FastAPI, SQLAlchemy, pydantic, torch-free but large) lives as long
        # as the process; moved out of the collector's reach, full collections stop pausing every
        # request for ~0.1 s (they were the whole p99 of the heartbeat route).
        gc.collect()
        gc.freeze()
        app.state.announcer.bind(asyncio.get_running_loop())
        if settings.wheel_dir is not None:
            app.state.wheels.start()  # found at once; a build from the tree waits for the index's first request
        sweeper = asyncio.create_task(retention.sweep_periodically(db, app.state.blobs, app.state.checkpoints,
                                                                   settings))
        yield
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        db.dispose()

    # Metrics are ours (/metrics, api/telemetry.py). FastAPI's own OpenTelemetry hooks, on by default, looked for
    # a configured provider on every request: 3 % of a heartbeat's CPU for nothing.
    # docs_url, redoc_url: served with their assets by api/openapi.py (FastAPI's pages load them from a CDN).
    app = _App(title="Echo2", version=VERSION, description=DESCRIPTION, lifespan=lifespan, docs_url=None,
               redoc_url=None, telemetry={"tracing": False, "metrics": False, "logs": False})
    app.state.settings, app.state.db = settings, db
    app.state.blobs = BlobStore(settings.blob_dir)
    app.state.checkpoints = BlobStore(settings.blob_dir, prefix="c")
    app.state.heartbeats = Heartbeats(db, settings)
    app.state.announcer = Announcer()
    app.state.tinker_watcher = tinker_futures.Watcher(db, app.state.announcer)
    app.state.registry = telemetry.registry
    app.state.wheels = WheelIndex(settings.wheel_dir, settings.data_dir)
    errors.install(app)
    openapi.install(app)
    for module in (health, users, estimates, jobs, datasets, fleet, ledger, leases, learner, learner_state, evals,
                   weights, export, traces, packages, tinker):
        app.include_router(module.router)
    app.heartbeat_path = functools.partial(
        HeartbeatPath, route=next(r for r in fleet.router.routes if getattr(r, "operation_id", None)
                                  == "worker_heartbeat"), telemetry=telemetry, limit=settings.max_body_bytes)
    app.add_middleware(errors.BodyLimit, default_limit=settings.max_body_bytes,
                       large_limit=settings.max_chunk_bytes, large_paths=CHUNK_PUTS)
    app.add_middleware(MetricsMiddleware, telemetry=telemetry)
    web.install(app)
    logs.configure(settings.log_format, settings.log_level)  # no-op when the CLI configured it first
    return app
