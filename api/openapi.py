"""The OpenAPI document, with the problem+json error bodies every route can answer documented."""

from __future__ import annotations

from typing import Any

from echo2.protocol import Problem
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERRORS = {
    "401": "Missing, unknown or revoked token.",
    "403": "The token is of the wrong kind or lacks the right.",
    "404": "Not found, or not yours.",
    "409": "Conflicts with the current state (e.g. a finished job).",
    "413": "Body too large.",
    "422": "Invalid input: `errors` names each field and the reason.",
}


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _build(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    problem = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(problem.pop("$defs", {}))
    components["Problem"] = problem
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    ref = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
    for path_item in schema["paths"].values():
        for op in path_item.values():
            _document_errors(op, ref)
    return schema


def _document_errors(op: dict[str, Any], ref: dict[str, Any]) -> None:
    """The errors every route can answer, and problem+json as the body of each error a route declares
    itself (e.g. 410, 416, 503)."""
    responses = op.setdefault("responses", {})
    for code, description in ERRORS.items():
        if code in ("401", "403") and "security" not in op:
            continue
        responses.setdefault(code, {"description": description})
    responses.setdefault("500", {"description": "Server error."})
    for code, response in responses.items():
        if code.startswith(("4", "5")):
            response["content"] = ref
