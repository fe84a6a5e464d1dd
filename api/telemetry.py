"""Prometheus metrics: request counts/latency per route, and fleet/job gauges read from the database
at scrape time (so every API replica reports the same truth)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .db import Database
from .models import EvalResult, Job, Rollout, Worker


class _DatabaseCollector(Collector):
    def __init__(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self.db.session() as s:
            yield _family(s, "echo2_jobs", "Jobs by status", Job.status)
            yield _family(s, "echo2_workers", "Workers by status", Worker.status)
            yield _family(s, "echo2_rollouts", "Rollout groups by status", Rollout.status)
            yield _held_out(s)


def _held_out(session) -> GaugeMetricFamily:  # type: ignore[no-untyped-def]
    """The latest held-out accuracy of every running job (its eval curve's last point)."""
    family = GaugeMetricFamily("echo2_job_heldout_accuracy", "Held-out accuracy of the newest evaluated version "
                               "(prompts the job never trains on)", labels=["job", "decoding"])
    latest = select(EvalResult.job_id, func.max(EvalResult.step).label("step")).group_by(EvalResult.job_id).subquery()
    rows = session.execute(select(EvalResult).join(latest, (EvalResult.job_id == latest.c.job_id)
                                                   & (EvalResult.step == latest.c.step))
                           .join(Job, Job.id == EvalResult.job_id).where(Job.status == "running"))
    for (row,) in rows:
        for decoding, value in (("greedy", row.greedy_accuracy), ("sampled", row.sampled_accuracy)):
            if value is not None:
                family.add_metric([row.job_id, decoding], value)
    return family


def _family(session, name: str, doc: str, column) -> GaugeMetricFamily:  # type: ignore[no-untyped-def]
    family = GaugeMetricFamily(name, doc, labels=["status"])
    for status, count in session.execute(select(column, func.count()).group_by(column)):
        family.add_metric([status], count)
    return family


class Telemetry:
    def __init__(self, db: Database) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("echo2_http_requests", "HTTP requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("echo2_http_request_seconds", "HTTP request latency", ["method", "route"],
                                 registry=self.registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
        self.registry.register(_DatabaseCollector(db))


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, telemetry: Telemetry) -> None:
        self.app, self.t = app, telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.t.requests.labels(scope["method"], route, str(status)).inc()
            self.t.latency.labels(scope["method"], route).observe(time.perf_counter() - start)
