"""The dashboard: HTML shells served by the control plane; the browser reads everything through the REST API.

Pages are server-rendered Jinja templates holding no data. Each page's script calls the public `/v1`
routes with the API key the user pasted at login (kept in sessionStorage), so the dashboard can do
exactly what the API allows, no more, and every call it makes is an API route with its own tests.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, FastAPI, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

HERE = Path(__file__).parent
STATIC = HERE / "static"
# Only same-origin scripts, styles and API calls; charts set element.style from script, which CSP allows.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
IdPath = Annotated[str, PathParam(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]


def _asset_version() -> str:
    """A digest of the static files, appended to their URLs so a new release is never served stale."""
    digest = hashlib.sha256()
    for path in sorted(STATIC.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def _router(templates: Jinja2Templates) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    def page(request: Request, template: str, title: str, **context: str) -> HTMLResponse:
        return templates.TemplateResponse(request, template, {"title": title, **context}, headers=SECURITY_HEADERS)

    @router.get("/")
    def home() -> RedirectResponse:
        return RedirectResponse("/jobs", status_code=307)

    @router.get("/login")
    def login(request: Request) -> HTMLResponse:
        return page(request, "login.html", "Log in")

    @router.get("/jobs")
    def jobs(request: Request) -> HTMLResponse:
        return page(request, "jobs.html", "Jobs")

    @router.get("/jobs/new")
    def new_job(request: Request) -> HTMLResponse:
        return page(request, "job_new.html", "Submit a job")

    @router.get("/jobs/{job_id}")
    def job(request: Request, job_id: IdPath) -> HTMLResponse:
        return page(request, "job.html", "Job", job_id=job_id)

    @router.get("/jobs/{job_id}/steps/{step}")
    def trace(request: Request, job_id: IdPath, step: Annotated[int, PathParam(ge=0, le=10_000_000)]) -> HTMLResponse:
        return page(request, "trace.html", "Rollout traces", job_id=job_id, step=str(step))

    @router.get("/workers")
    def workers(request: Request) -> HTMLResponse:
        return page(request, "workers.html", "Workers")

    @router.get("/workers/{worker_id}")
    def worker(request: Request, worker_id: IdPath) -> HTMLResponse:
        return page(request, "worker.html", "Worker", worker_id=worker_id)

    @router.get("/provider")
    def provider(request: Request) -> HTMLResponse:
        return page(request, "provider.html", "Provider")

    @router.get("/admin")
    def admin(request: Request) -> HTMLResponse:
        return page(request, "admin.html", "Admin")

    return router


def install(app: FastAPI) -> None:
    """Mount the dashboard pages at `/` and their assets at `/static`."""
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.globals["asset_version"] = _asset_version()
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.include_router(_router(templates))
