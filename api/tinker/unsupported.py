"""Every other Tinker route answers 404 at once, naming the SDK method, so no client waits or retries."""

from __future__ import annotations

from fastapi import Request

from ..errors import ApiError
from ..routing import make_router

router = make_router(prefix="/api/v1", tags=["tinker"], include_in_schema=False)


@router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
def unsupported(rest: str, request: Request) -> None:
    method = request.headers.get("x-sdk-method", "")[:128]
    what = f" ({method})" if method else ""
    raise ApiError(404, f"Echo2 does not implement the Tinker call {request.method} /api/v1/{rest[:200]}{what}; "
                        "docs/TINKER.md lists what it supports")
