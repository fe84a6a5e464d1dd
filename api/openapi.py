"""The OpenAPI document, with the problem+json error bodies every route can answer documented."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fastapi_offline
from echo2.protocol import Problem
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

# Swagger UI's and ReDoc's scripts, served from here: FastAPI's pages load them from a CDN, which a control plane
# on a private network (or any machine offline) cannot reach, and the page stays blank.
ASSETS = Path(fastapi_offline.__file__).parent / "static"
ASSETS_URL = "/docs-assets"

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
    _install_docs(app)


def _install_docs(app: FastAPI) -> None:
    """/docs (Swagger UI) and /redoc on assets served by this app (the app is made with docs_url=None)."""
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def swagger(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} API",
                                   swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
                                   swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png")

    @app.get("/redoc", include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} API",
                              redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js", with_google_fonts=False,
                              redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png")


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
