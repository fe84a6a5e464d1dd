"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from ..deps import AdminUser
from ..errors import ApiError
from ..routing import make_router

router = make_router(tags=["health"])


@router.get("/healthz", operation_id="healthz", summary="The process is up")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", operation_id="readyz", summary="The database answers",
            responses={503: {"description": "The database does not answer."}})
def readyz(request: Request) -> dict[str, str]:
    try:
        with request.app.state.db.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        raise ApiError(503, f"database not reachable: {type(exc).__name__}") from None
    return {"status": "ready"}


@router.get("/metrics", operation_id="prometheus_metrics", summary="Prometheus text exposition",
            description="For an admin's API key: its series name every tenant's jobs (rewards, costs, accuracy) "
                        "and every provider's workers (trust, earnings), which no other token may read.",
            response_class=Response, responses={200: {"content": {"text/plain": {}}}})
def metrics(request: Request, _: AdminUser) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
